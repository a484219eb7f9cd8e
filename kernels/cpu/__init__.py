"""Native C kernels (<stem>.c), compiled on first use by loader.py and called through ctypes."""
