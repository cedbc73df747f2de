// The data path's two messages, an expert call and its result, to and from the wire in one call each
// (fabric/messages/fast.py uses these where the module is loaded, its own msgspec codec elsewhere).
//
// In Python a call's encode took ~4 µs in a loop and ~22 in place on the AVX2 VM, its decode ~7 and ~25, most of it
// the glue around msgspec and the tensor's trip through numpy (docs/performance.md). Here the header is written and
// read by hand, the tensor's bytes are copied into the message (a small one) or viewed where they lie (a received
// frame), and nothing else is made.
//
// The bytes are msgpack as fabric/wire.py writes them, byte for byte: the prefix, the frame table, a map whose keys
// come in the message's field order after "kind", each integer in its shortest form, and the frame. The decoder
// takes only that form (the keys in that order, the shortest integers, a float64, a writable buffer); anything
// else it leaves to the Python decoders (it returns None), whose verdict then stands. It reads only within the
// buffer: every length is checked before what it covers is read.
//
// codec_write.cpp writes them, codec_read.cpp reads them; this header holds what both share.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace codec {

namespace py = pybind11;

// The wire's dtype names (fabric/messages/base.py, TORCH_DTYPE_NAMES) and their scalar types.
struct Dtype {
  const char* name;
  at::ScalarType type;
};
inline const Dtype kDtypes[] = {{"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf},
                         {"int64", at::kLong},    {"int32", at::kInt},         {"int16", at::kShort}};

inline const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  return nullptr;
}

// A call (`is_call`) or a result as wire bytes: (the whole message, true) where its frame is under `join_below`
// bytes, else (everything before the frame, false), the frame then sent from the tensor's memory; None where the
// message is not one this writes (a field of another type, a tensor not contiguous on the host...). codec_write.cpp.
py::object encode_data(py::handle msg_h, bool is_call, int64_t join_below);

// The attribute names `encode_data` reads, interned once before its first call. codec_write.cpp.
void intern_names();

// The message of a body (what follows the prefix: the frame table, the header of `header_len` bytes, one frame),
// made with `call_cls` or `result_cls`; None for anything else. codec_read.cpp.
py::object decode_data(py::handle body_h, int64_t header_len, py::handle call_cls, py::handle result_cls);

// Both into the kernel module (skinny_gemm.cpp's PYBIND11_MODULE).
inline void register_codec(py::module_& m) {
  intern_names();
  m.def("encode_data", &encode_data,
        "an expert call (is_call) or result -> (wire bytes, whether the frame is in them: under join_below bytes), "
        "or None");
  m.def("decode_data", &decode_data,
        "a call's or result's body (the frame table, a header of header_len bytes, one frame), made with call_cls "
        "or result_cls, its tensor a view of the body; or None");
}

}  // namespace codec
