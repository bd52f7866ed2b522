"""What runs leave on disk and how it gets there: the tidy metrics schema and the atomic writers.

`schema`: the long metrics table (factor columns, types, validation, read/write) and samples columns;
`atomic`: temp-file-then-rename writers for bytes, text, JSON and parquet, used by every layer.

May import: nothing else of marlflow (the bottom floor, beside `marlflow.sandbox`).
"""
