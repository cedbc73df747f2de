"""Compiled CPU kernels (C++ in sixteen-lane vectors: AVX-512, or AVX2 two registers a vector; `simd.h`).

Each is built once per machine into the cache and loaded by the processes that use it. Where one cannot be built
or run here, its users fall back to torch."""
