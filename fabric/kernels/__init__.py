"""Compiled CPU kernels (C++ with AVX-512).

Each is built once per machine into the cache and loaded by the processes that use it. Where one cannot be built
or run here, its users fall back to torch."""
