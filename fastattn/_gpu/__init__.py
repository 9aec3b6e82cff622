"""CUDA kernels compiled at run time by NVRTC through CuPy. Import through ``fastattn.backends.cuda``."""
