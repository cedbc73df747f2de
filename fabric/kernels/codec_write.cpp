// An expert call or result as wire bytes, in one call (codec.h: the format).

#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <utility>
#include <vector>

#include "codec.h"

namespace codec {
namespace {

struct Writer {
  std::string s;
  void byte(uint8_t b) { s.push_back(static_cast<char>(b)); }
  void be(uint64_t v, int n) {  // n bytes, big-endian, as msgpack's
    for (int i = n - 1; i >= 0; --i) byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  void uint(uint64_t v) {
    if (v < 128) byte(static_cast<uint8_t>(v));
    else if (v < 256) { byte(0xcc); be(v, 1); }
    else if (v < 65536) { byte(0xcd); be(v, 2); }
    else if (v <= 0xffffffffull) { byte(0xce); be(v, 4); }
    else { byte(0xcf); be(v, 8); }
  }
  void sint(int64_t v) {
    if (v >= 0) return uint(static_cast<uint64_t>(v));
    if (v >= -32) byte(static_cast<uint8_t>(v));
    else if (v >= -128) { byte(0xd0); be(static_cast<uint64_t>(v), 1); }
    else if (v >= -32768) { byte(0xd1); be(static_cast<uint64_t>(v), 2); }
    else if (v >= INT32_MIN) { byte(0xd2); be(static_cast<uint64_t>(v), 4); }
    else { byte(0xd3); be(static_cast<uint64_t>(v), 8); }
  }
  void str(const char* p) {
    size_t n = std::strlen(p);  // (names here: under 32 bytes)
    byte(static_cast<uint8_t>(0xa0 | n));
    s.append(p, n);
  }
  void array(size_t n) {
    if (n < 16) byte(static_cast<uint8_t>(0x90 | n));
    else if (n < 65536) { byte(0xdc); be(n, 2); }
    else { byte(0xdd); be(n, 4); }
  }
  void f64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    byte(0xcb);
    be(bits, 8);
  }
};

// A Python int into the writer; false where it is not an exact int or does not fit 64 bits (the caller then leaves
// the message to the Python codec, which raises or writes it as it does).
bool put_int(Writer& w, PyObject* o) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow > 0) {
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    w.uint(u);
    return true;
  }
  if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  w.sint(v);
  return true;
}

bool put_ints(Writer& w, PyObject* list) {
  if (!PyList_CheckExact(list)) return false;
  Py_ssize_t n = PyList_GET_SIZE(list);
  w.array(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!put_int(w, PyList_GET_ITEM(list, i))) return false;
  return true;
}

bool put_bool(Writer& w, PyObject* o) {
  if (o != Py_True && o != Py_False) return false;
  w.byte(o == Py_True ? 0xc3 : 0xc2);
  return true;
}

// The attribute names, interned once (`intern_names`).
struct Names {
  PyObject *x, *y, *call_id, *epoch, *layer, *experts, *counts, *replay, *pads, *others, *batch_s;
};
Names names;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // (kept for the life of the process)
}

// An attribute of the message (a new reference kept in `held`), or null.
PyObject* attr(PyObject* msg, PyObject* name, std::vector<py::object>& held) {
  PyObject* v = PyObject_GetAttr(msg, name);
  if (v == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  held.push_back(py::reinterpret_steal<py::object>(v));
  return v;
}

}  // namespace

void intern_names() {
  names = Names{interned("x"),      interned("y"),      interned("call_id"), interned("epoch"),
                interned("layer"),  interned("experts"), interned("counts"), interned("replay"),
                interned("pads"),   interned("others"), interned("batch_s")};
}

py::object encode_data(py::handle msg_h, bool is_call, int64_t join_below) {
  PyObject* msg = msg_h.ptr();
  std::vector<py::object> held;
  Writer w;
  w.s.reserve(160);
  PyObject* t_obj = attr(msg, is_call ? names.x : names.y, held);
  if (t_obj == nullptr || !THPVariable_Check(t_obj)) return py::none();
  const at::Tensor& t = THPVariable_Unpack(t_obj);
  if (t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous() || t.is_conj() || t.is_neg())
    return py::none();
  const char* dt = dtype_name(t.scalar_type());
  if (dt == nullptr) return py::none();
  const uint64_t frame = static_cast<uint64_t>(t.numel()) * t.element_size();

  w.byte(is_call ? 0x89 : 0x85);  // a map of 9 (call) or 5 (result) keys
  w.str("kind");
  w.str(is_call ? "expert_call" : "expert_result");
  w.str("call_id");
  PyObject* v = attr(msg, names.call_id, held);
  if (v == nullptr || !put_int(w, v)) return py::none();
  if (is_call) {
    for (auto [key, name] : {std::pair{"epoch", names.epoch}, std::pair{"layer", names.layer}}) {
      w.str(key);
      v = attr(msg, name, held);
      if (v == nullptr || !put_int(w, v)) return py::none();
    }
    for (auto [key, name] : {std::pair{"experts", names.experts}, std::pair{"counts", names.counts}}) {
      w.str(key);
      v = attr(msg, name, held);
      if (v == nullptr || !put_ints(w, v)) return py::none();
    }
  }
  w.str(is_call ? "x" : "y");
  w.array(3);  // the tensor: [dtype, shape, frame 0]
  w.str(dt);
  w.array(static_cast<size_t>(t.dim()));
  for (int64_t d : t.sizes()) w.uint(static_cast<uint64_t>(d));
  w.byte(0x00);
  if (is_call) {
    for (auto [key, name] : {std::pair{"replay", names.replay}, std::pair{"pads", names.pads}}) {
      w.str(key);
      v = attr(msg, name, held);
      if (v == nullptr || !put_bool(w, v)) return py::none();
    }
  } else {
    w.str("others");
    v = attr(msg, names.others, held);
    if (v == nullptr || !put_bool(w, v)) return py::none();
    w.str("batch_s");
    v = attr(msg, names.batch_s, held);
    if (v == nullptr || !PyFloat_CheckExact(v)) return py::none();
    w.f64(PyFloat_AS_DOUBLE(v));
  }

  const uint64_t header = w.s.size();
  const bool join = static_cast<int64_t>(frame) < join_below;
  const uint64_t total = 20 + 8 + header + (join ? frame : 0);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (out == nullptr) throw py::error_already_set();
  char* p = PyBytes_AS_STRING(out);
  const uint32_t h32 = static_cast<uint32_t>(header), one = 1;
  const uint64_t body = 8 + header + frame;
  std::memcpy(p, "MoF1", 4);  // the prefix, little-endian (fabric/wire.py)
  std::memcpy(p + 4, &h32, 4);
  std::memcpy(p + 8, &one, 4);
  std::memcpy(p + 12, &body, 8);
  std::memcpy(p + 20, &frame, 8);  // the frame table
  std::memcpy(p + 28, w.s.data(), header);
  if (join && frame) std::memcpy(p + 28 + header, t.data_ptr(), frame);
  return py::make_tuple(py::reinterpret_steal<py::object>(out), join);
}

}  // namespace codec
