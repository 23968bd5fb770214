"""lighteval model for qerl checkpoints (+ LoRA adapter), and the offline lighteval run.

    from qerl.eval.lighteval_model import QerlLightevalModel, QerlLightevalModelConfig, run_lighteval
    model = QerlLightevalModel(QerlLightevalModelConfig(checkpoint=ckpt, adapter=adapter_dir))
    result, meta = run_lighteval(ckpt, adapter_dir, "aime24", data_dir="../shared/data", limit=5,
                                 generation=GenerationSettings(temperature=0.6, top_p=0.95, max_new_tokens=8192),
                                 num_samples=4)   # (via qerl.eval.harness.evaluate_with_harness)

QerlLightevalModel is a lighteval `LightevalModel` (lighteval's custom-model interface):
- greedy_until: the prompt by lighteval's PromptManager (chat template on by default, as the
  paper evaluates), doc.num_samples completions per doc from qerl's decoding loop
  (qerl.eval.generate.generate; greedy at temperature 0, else temperature / top_p sampling),
  at most doc.generation_size new tokens, cut at the doc's stop sequences;
- loglikelihood: the log-probability of each choice given the prompt (one forward pass);
- loglikelihood_rolling: the log-probability of the whole prompt, in windows of max_length.
lighteval's SampleCache is not used: it keys cached answers by the model config, and a
completion generated with one adapter must never be served for another.

The file also works as a `--custom` model definition for lighteval's CLI (it holds exactly
one LightevalModel subclass), but that CLI cannot run offline (see qerl.eval.lighteval_tasks);
run_lighteval drives lighteval's Pipeline with a registry holding only qerl's local tasks.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch

# lighteval's transformers model module calls torch.set_grad_enabled(False) when imported (and
# this package pulls it in through lighteval.pipeline): that would switch autograd off for the
# whole process, e.g. for a training step that runs after an evaluation. Every lighteval import
# here restores the caller's grad mode (_keep_grad_mode).
_GRAD_MODE = torch.is_grad_enabled()
from lighteval.models.abstract_model import LightevalModel, ModelConfig  # noqa: E402
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.prompt_manager import PromptManager
from lighteval.tasks.requests import Doc

torch.set_grad_enabled(_GRAD_MODE)

from qerl.eval.harness import HarnessError, load_for_eval, records_summary, score_continuations, truncate_at

log = logging.getLogger(__name__)


class QerlLightevalModelConfig(ModelConfig):
    """lighteval model config: a qerl checkpoint dir, an optional PEFT adapter dir, decoding.

    generation_parameters (lighteval's) sets temperature / top_p / top_k / max_new_tokens /
    seed; a doc's generation_size caps max_new_tokens.
    """

    model_name: str = "qerl"
    checkpoint: str
    adapter: str | None = None
    device: str = "cpu"
    compute_dtype: str | None = None
    batch_size: int = 8
    max_new_tokens: int = 8192
    use_chat_template: bool = True
    max_length: int | None = None


class _NoSampleCache:
    """Stands in for lighteval's SampleCache, which Pipeline wires up: nothing is cached."""

    registry = None

    def _init_registry(self, registry) -> None:
        self.registry = registry


class QerlLightevalModel(LightevalModel):
    """lighteval model over a qerl checkpoint (+ adapter); see the module docstring."""

    def __init__(self, config: QerlLightevalModelConfig, model=None, tokenizer=None):
        self.config = config
        if model is None:
            model, tokenizer = load_for_eval(config.checkpoint, config.adapter, config.device, config.compute_dtype)
        elif tokenizer is None:
            raise HarnessError("QerlLightevalModel(model=...) needs the tokenizer too")
        self.model = model
        self._tokenizer = tokenizer
        self._cache = _NoSampleCache()
        self.prompt_manager = PromptManager(
            use_chat_template=config.use_chat_template, tokenizer=tokenizer, system_prompt=config.system_prompt
        )
        cfg_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._max_length = int(config.max_length or cfg_len or 2048)
        # prompt -> the qerl Generation objects for it (entropy, tokens, finished), for records
        self.generations: dict[str, list] = {}

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def add_special_tokens(self) -> bool:
        return False  # the chat template carries the special tokens, as in qerl's own evaluator

    @property
    def max_length(self) -> int:
        return self._max_length

    def _settings(self, max_new_tokens: int | None, num_samples: int):
        from qerl.eval.generate import GenerationSettings

        gp = self.config.generation_parameters
        temperature = float(gp.temperature or 0.0)
        if num_samples > 1 and temperature == 0.0:
            raise HarnessError(
                f"{num_samples} samples per problem need temperature > 0 (greedy decoding repeats the same sample)"
            )
        cap = int(gp.max_new_tokens or self.config.max_new_tokens)
        return GenerationSettings(
            max_new_tokens=min(cap, int(max_new_tokens)) if max_new_tokens else cap,
            temperature=temperature,
            top_p=float(gp.top_p) if gp.top_p is not None and temperature > 0 else 1.0,
            top_k=int(gp.top_k) if gp.top_k and temperature > 0 else 0,
            batch_size=self.config.batch_size,
            seed=int(gp.seed) if gp.seed is not None else 0,
        )

    def greedy_until(self, docs: list[Doc]) -> list[ModelResponse]:
        from qerl.eval.generate import generate

        out: list[ModelResponse | None] = [None] * len(docs)
        groups: dict[tuple, list[int]] = {}
        for i, d in enumerate(docs):
            groups.setdefault((d.generation_size, max(1, d.num_samples or 1), tuple(d.stop_sequences or ())), []).append(i)
        for (size, k, stops), idx in groups.items():
            settings = self._settings(size, k)
            prompts = [self.prompt_manager.prepare_prompt(docs[i]) for i in idx]
            expanded = [p for p in prompts for _ in range(k)]  # problem-major, like qerl's evaluator
            gens = generate(self.model, self.tokenizer, expanded, settings, progress=not self.disable_tqdm)
            for j, (i, prompt) in enumerate(zip(idx, prompts)):
                mine = gens[j * k : (j + 1) * k]
                self.generations[prompt] = mine
                out[i] = ModelResponse(
                    input=prompt,
                    input_tokens=self.tokenizer.encode(prompt, add_special_tokens=False),
                    text=[truncate_at(g.text, list(stops)) for g in mine],
                    output_tokens=[g.token_ids for g in mine],
                )
        return out  # type: ignore[return-value]

    def loglikelihood(self, docs: list[Doc]) -> list[ModelResponse]:
        out = []
        for d in docs:
            prompt = self.prompt_manager.prepare_prompt(d)
            ctx_encs, cont_encs = self.tok_encode_pair(prompt, list(d.choices), pairwise=True)
            scores = score_continuations(self.model, list(zip(ctx_encs, cont_encs)), self.config.batch_size, self.max_length)
            out.append(
                ModelResponse(
                    input=prompt,
                    input_tokens=list(ctx_encs[0]) if ctx_encs else [],
                    logprobs=[s for s, _ in scores],
                    argmax_logits_eq_gold=[g for _, g in scores],
                    output_tokens=[list(c) for c in cont_encs],
                )
            )
        return out

    def loglikelihood_rolling(self, docs: list[Doc]) -> list[ModelResponse]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # the same windowing as lm-eval

        out = []
        prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        for d in docs:
            text = self.prompt_manager.prepare_prompt(d)
            toks = self.tokenizer.encode(text, add_special_tokens=False)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(toks, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)
            ]
            scores = score_continuations(self.model, windows, self.config.batch_size, self.max_length)
            out.append(ModelResponse(input=text, input_tokens=toks, logprobs=[float(sum(s for s, _ in scores))]))
        return out


# ----------------------------------------------------------------------------- offline pipeline


def _xxhash_str_compat() -> None:
    """lighteval 0.13's DetailsLogger hashes str with xxhash.xxh64, which xxhash >= 4 refuses
    ("Strings must be encoded before hashing"); lighteval does not pin xxhash. Give its logger
    module an xxhash whose xxh64 UTF-8-encodes str (what xxhash < 4 did); nothing else changes."""
    import lighteval.logging.info_loggers as il
    import xxhash

    try:
        xxhash.xxh64("")
        return
    except TypeError:
        pass

    class _XXHashStrCompat:
        def __getattr__(self, name):
            return getattr(xxhash, name)

        @staticmethod
        def xxh64(data=b"", *args, **kwargs):
            return xxhash.xxh64(data.encode("utf-8") if isinstance(data, str) else data, *args, **kwargs)

    il.xxhash = _XXHashStrCompat()



def _local_registry(configs, tasks: str):
    """A lighteval Registry holding only `configs` (lighteval's own __init__ imports every built-in
    task module, one of which downloads at import time; the other methods are lighteval's)."""
    from lighteval.tasks.registry import Registry

    class LocalRegistry(Registry):
        def __init__(self) -> None:  # noqa: D401 - see _local_registry
            self.tasks_list = self._get_full_task_list_from_input_string(tasks)
            self._load_multilingual = False
            self._custom_tasks = None
            self._task_registry = {c.name: c for c in configs}
            self.task_to_configs = self._update_task_configs()

    return LocalRegistry()


def _pipeline_class():
    import collections

    from lighteval.pipeline import Pipeline
    from lighteval.tasks.lighteval_task import LightevalTask

    class LocalPipeline(Pipeline):
        """lighteval's Pipeline with the task registry of qerl's local tasks (no hub, no built-ins)."""

        local_configs: list = []

        def _init_tasks_and_requests(self, tasks: str):  # same steps as lighteval's, other registry
            self.registry = _local_registry(self.local_configs, tasks)
            self.tasks_dict = self.registry.load_tasks()
            LightevalTask.load_datasets(self.tasks_dict, self.pipeline_parameters.dataset_loading_processes)
            self.documents_dict = {
                task.full_name: task.get_docs(self.pipeline_parameters.max_samples) for _, task in self.tasks_dict.items()
            }
            self.sampling_docs = collections.defaultdict(list)
            for _, docs in self.documents_dict.items():
                for doc in docs:
                    for sampling in doc.sampling_methods:
                        self.sampling_docs[sampling].append(doc)
            self.evaluation_tracker.task_config_logger.log(self.tasks_dict)

    return LocalPipeline


def run_lighteval(*args, **kwargs):
    """See _run_lighteval; the caller's autograd mode survives lighteval's imports and run."""
    grad = torch.is_grad_enabled()
    try:
        return _run_lighteval(*args, **kwargs)
    finally:
        torch.set_grad_enabled(grad)


def _run_lighteval(
    checkpoint,
    adapter,
    benchmark: str,
    *,
    data_dir,
    limit,
    generation,
    device: str = "cpu",
    compute_dtype: str | None = None,
    model=None,
    tokenizer=None,
    base_meta: dict | None = None,
    use_chat_template: bool = True,
    progress: bool = True,
) -> tuple[Any, dict]:
    """Evaluate one benchmark (qerl name: math500 / aime24 / aime25 / amc23) through lighteval."""
    import lighteval
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.model_input import GenerationParameters
    from lighteval.pipeline import ParallelismManager, PipelineParameters

    from qerl.eval.harness import LIGHTEVAL_TASKS
    from qerl.eval.lighteval_tasks import TASK_VERSION, make_task_configs

    if benchmark not in LIGHTEVAL_TASKS:
        raise HarnessError(f"unknown task {benchmark!r} for lighteval; valid: {', '.join(LIGHTEVAL_TASKS)}")
    task = LIGHTEVAL_TASKS[benchmark]
    k = generation.num_samples
    configs = make_task_configs(data_dir, [task], num_samples=k, max_new_tokens=generation.max_new_tokens, limit=limit)
    cfg = QerlLightevalModelConfig(
        checkpoint=str(checkpoint), adapter=str(adapter) if adapter else None, device=device,
        compute_dtype=compute_dtype, batch_size=generation.batch_size, max_new_tokens=generation.max_new_tokens,
        use_chat_template=use_chat_template,
        generation_parameters=GenerationParameters(
            temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k or None,
            max_new_tokens=generation.max_new_tokens, seed=generation.seed,
        ),
    )
    if model is None:
        model, tokenizer = load_for_eval(checkpoint, adapter, device, compute_dtype)
    lm = QerlLightevalModel(cfg, model=model, tokenizer=tokenizer)
    _xxhash_str_compat()
    Pipe = _pipeline_class()
    Pipe.local_configs = configs
    with tempfile.TemporaryDirectory(prefix="qerl-lighteval-") as tmp:
        tracker = EvaluationTracker(output_dir=tmp, save_details=False)
        pipe = Pipe(
            tasks=f"{task}|0",
            pipeline_parameters=PipelineParameters(launcher_type=ParallelismManager.NONE, bootstrap_iters=0),
            evaluation_tracker=tracker,
            model=lm,
        )
        pipe.evaluate()
        results = pipe.get_results()
        details = pipe.get_details()
    full = f"{task}|0"
    metric_name = configs[0].metrics[0].metric_name
    task_res = results["results"].get(full.replace("|", ":")) or results["results"].get(full)
    if task_res is None:
        raise RuntimeError(f"lighteval returned no results for {full}: keys {sorted(results['results'])}, details {sorted(details)}")
    records = []
    n_docs = 0
    for det in sorted(details[full], key=lambda d: int(d.doc.id)):
        n_docs += 1
        doc, resp = det.doc, det.model_response
        prompt = resp.input
        gens = lm.generations.get(prompt) or []
        from qerl.eval.grading import extract_answer, grade

        for s, text in enumerate(resp.final_text):
            g = gens[s] if s < len(gens) else None
            records.append(
                {
                    "id": (doc.specific or {}).get("id", doc.id),
                    "sample": s,
                    "question": (doc.specific or {}).get("question", doc.query),
                    "gold": doc.get_golds()[0],
                    "completion": text,
                    "extracted": extract_answer(benchmark, text),
                    "correct": bool(grade(benchmark, text, doc.get_golds()[0])),
                    "num_tokens": g.num_tokens if g else None,
                    "entropy": g.mean_entropy if g else None,
                    "finished": g.finished if g else None,
                    "lighteval_score": det.metric.get(metric_name),
                }
            )
    result = records_summary(benchmark, records, k, n_docs)
    if abs(task_res[metric_name] - result.accuracy) > 1e-6:
        raise RuntimeError(f"lighteval reports {metric_name}={task_res[metric_name]} but its samples give {result.accuracy}")
    meta = {
        **(base_meta or {}),
        "harness": "lighteval",
        "harness_version": lighteval.__version__ if hasattr(lighteval, "__version__") else _dist_version("lighteval"),
        "task": task,
        "task_version": TASK_VERSION,
        "task_config": f"qerl.eval.lighteval_tasks ({task}: local {configs[0].hf_repo}/test.jsonl, qerl prompt, chat template {'on' if use_chat_template else 'off'})",
        "metric": f"{metric_name} (math-verify via qerl.eval.grading)",
        "metrics": {k_: v for k_, v in task_res.items() if not k_.endswith("_stderr")},
    }
    return result, meta


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


__all__ = ["QerlLightevalModel", "QerlLightevalModelConfig", "run_lighteval"]
