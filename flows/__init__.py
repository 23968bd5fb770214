"""Prefect flows. `reproduce-table`: quantize -> evaluate per format, then report (Table 1, base rows)."""
