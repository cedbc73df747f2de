"""Compiled CPU kernels (C++ with AVX-512), built once per machine into the cache and loaded by
the processes that use them; where one cannot be built or run here, its users fall back to torch."""
