"""Float64 golden implementations (NumPy + ml_dtypes only; no framework imports)."""
