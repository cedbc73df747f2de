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
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// The wire's dtype names (fabric/messages/base.py, TORCH_DTYPE_NAMES) and their scalar types.
struct Dtype {
  const char* name;
  at::ScalarType type;
};
const Dtype kDtypes[] = {{"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf},
                         {"int64", at::kLong},    {"int32", at::kInt},         {"int16", at::kShort}};

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  return nullptr;
}

// ---- writing --------------------------------------------------------------------------------------------------
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

// The attribute names, interned once (`register_codec`).
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

// A call (`is_call`) or a result as wire bytes: (the whole message, true) where its frame is under `join_below`
// bytes, else (everything before the frame, false), the frame then sent from the tensor's memory; None where the
// message is not one this writes (a field of another type, a tensor not contiguous on the host...).
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

// ---- reading --------------------------------------------------------------------------------------------------
struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;

  bool need(size_t n) {
    if (ok && static_cast<size_t>(end - p) < n) ok = false;
    return ok;
  }
  uint8_t byte() { return need(1) ? *p++ : 0; }
  uint64_t be(int n) {
    if (!need(static_cast<size_t>(n))) return 0;
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | *p++;
    return v;
  }
  // A key or short string: exactly `want` as a fixstr.
  void expect(const char* want) {
    size_t n = std::strlen(want);
    if (byte() != (0xa0 | n) || !need(n) || std::memcmp(p, want, n) != 0) {
      ok = false;
      return;
    }
    p += n;
  }
  // An unsigned integer whose type byte `b` was read, in its shortest form; false for any other.
  bool uint_of(uint8_t b, uint64_t& u) {
    static const uint64_t least[] = {128, 256, 65536, 0x100000000ull};  // 0xcc..0xcf: 1, 2, 4, 8 bytes
    if (b < 0x80) u = b;
    else if (b >= 0xcc && b <= 0xcf) { u = be(1 << (b - 0xcc)); ok = ok && u >= least[b - 0xcc]; }
    else return false;
    return ok;
  }
  // An integer in the form Writer writes it (the shortest): as a Python int.
  py::object integer() {
    uint8_t b = byte();
    uint64_t u;
    if (!ok) return py::object();
    if (uint_of(b, u)) return py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(u));
    if (b >= 0xe0) return py::int_(static_cast<int8_t>(b));
    if (b < 0xd0 || b > 0xd3) { ok = false; return py::object(); }
    static const int64_t above[] = {-32, -128, -32768, INT32_MIN};  // 0xd0..0xd3: the shorter form's least
    const int n = 1 << (b - 0xd0);
    const uint64_t raw = be(n);
    const int64_t v = n == 8 ? static_cast<int64_t>(raw) : static_cast<int64_t>(raw << (64 - 8 * n)) >> (64 - 8 * n);
    ok = ok && v < above[b - 0xd0];
    return ok ? py::int_(v) : py::object();
  }
  size_t array() {
    uint8_t b = byte();
    if ((b & 0xf0) == 0x90) return b & 0x0f;
    if (b == 0xdc) { size_t n = be(2); if (n < 16) ok = false; return n; }
    if (b == 0xdd) { size_t n = be(4); if (n < 65536) ok = false; return n; }
    ok = false;
    return 0;
  }
  py::object ints() {
    size_t n = array();
    if (!ok || !need(n)) return py::object();  // (each takes a byte at least)
    py::list out(n);
    for (size_t i = 0; i < n; ++i) {
      py::object v = integer();
      if (!ok) return py::object();
      out[i] = std::move(v);
    }
    return std::move(out);
  }
  py::object boolean() {
    uint8_t b = byte();
    if (b == 0xc3) return py::bool_(true);
    if (b == 0xc2) return py::bool_(false);
    ok = false;
    return py::object();
  }
};

// The deleter of a tensor that views a received buffer: the buffer's export, released with the GIL held.
void release_view(void* ctx) {
  auto* view = static_cast<Py_buffer*>(ctx);
  if (Py_IsInitialized()) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyBuffer_Release(view);
    PyGILState_Release(g);
  }
  delete view;
}

// The tensor of a header's [dtype, shape, 0], viewing the frame at body[start:start + n]; an undefined tensor
// where they disagree.
at::Tensor tensor(Reader& r, PyObject* body, const uint8_t* base, size_t start, size_t n) {
  if (r.array() != 3 || !r.ok) return at::Tensor();
  uint8_t b = r.byte();
  size_t len = b & 0x1f;
  if ((b & 0xe0) != 0xa0 || !r.need(len)) { r.ok = false; return at::Tensor(); }
  const Dtype* dt = nullptr;
  for (const auto& d : kDtypes)
    if (std::strlen(d.name) == len && std::memcmp(r.p, d.name, len) == 0) dt = &d;
  r.p += len;
  if (dt == nullptr) { r.ok = false; return at::Tensor(); }
  size_t dims = r.array();
  if (!r.ok || !r.need(dims)) { r.ok = false; return at::Tensor(); }
  std::vector<int64_t> shape(dims);
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t i = 0; i < dims; ++i) {
    uint64_t d;
    if (!r.uint_of(r.byte(), d) || d > 0xffffffffull) {  // (negative, or past 2^32: the Python decoders judge)
      r.ok = false;
      return at::Tensor();
    }
    shape[i] = static_cast<int64_t>(d);
    if (d && numel > UINT64_MAX / d) overflow = true;
    numel *= d;
  }
  if (r.byte() != 0x00 || !r.ok || overflow) { r.ok = false; return at::Tensor(); }
  const uint64_t item = c10::elementSize(dt->type);
  if (numel > UINT64_MAX / item || numel * item != n) { r.ok = false; return at::Tensor(); }
  auto opts = at::TensorOptions().dtype(dt->type);
  if (numel == 0) return at::empty(shape, opts);
  auto* view = new Py_buffer;
  if (PyObject_GetBuffer(body, view, PyBUF_WRITABLE) != 0) {  // (holds the buffer while the tensor lives)
    PyErr_Clear();
    delete view;
    r.ok = false;
    return at::Tensor();
  }
  if (static_cast<const uint8_t*>(view->buf) != base) {  // (the export must be the memory parsed)
    PyBuffer_Release(view);
    delete view;
    r.ok = false;
    return at::Tensor();
  }
  return at::from_blob(static_cast<uint8_t*>(view->buf) + start, shape, [view](void*) { release_view(view); }, opts);
}

// The message of a body (what follows the prefix: the frame table, the header of `header_len` bytes, one frame),
// made with `call_cls` or `result_cls`; None for anything else.
py::object decode_data(py::handle body_h, int64_t header_len, py::handle call_cls, py::handle result_cls) {
  PyObject* body = body_h.ptr();
  Py_buffer whole;
  if (PyObject_GetBuffer(body, &whole, PyBUF_WRITABLE) != 0) {  // (a read-only buffer: the Python decoders)
    PyErr_Clear();
    return py::none();
  }
  const uint8_t* base = static_cast<const uint8_t*>(whole.buf);
  const size_t size = static_cast<size_t>(whole.len);
  PyBuffer_Release(&whole);  // (the caller holds `body` through this call; the tensor takes an export of its own)
  if (header_len <= 0 || size < 8 || static_cast<uint64_t>(header_len) > size - 8) return py::none();
  uint64_t n;
  std::memcpy(&n, base, 8);
  const size_t start = 8 + static_cast<size_t>(header_len);
  if (n != size - start) return py::none();
  Reader r{base + 8, base + start};
  const uint8_t map = r.byte();
  const bool is_call = map == 0x89;
  if (!is_call && map != 0x85) return py::none();
  r.expect("kind");
  r.expect(is_call ? "expert_call" : "expert_result");
  r.expect("call_id");
  py::object call_id = r.integer();
  if (!r.ok) return py::none();
  if (is_call) {
    r.expect("epoch");
    py::object epoch = r.integer();
    r.expect("layer");
    py::object layer = r.integer();
    r.expect("experts");
    py::object experts = r.ints();
    r.expect("counts");
    py::object counts = r.ints();
    r.expect("x");
    if (!r.ok) return py::none();
    at::Tensor x = tensor(r, body, base, start, n);
    r.expect("replay");
    py::object replay = r.boolean();
    r.expect("pads");
    py::object pads = r.boolean();
    if (!r.ok || r.p != r.end || !x.defined()) return py::none();
    return call_cls(call_id, epoch, layer, experts, counts, py::reinterpret_steal<py::object>(THPVariable_Wrap(x)),
                    replay, pads);
  }
  r.expect("y");
  if (!r.ok) return py::none();
  at::Tensor y = tensor(r, body, base, start, n);
  r.expect("others");
  py::object others = r.boolean();
  r.expect("batch_s");
  double batch_s = 0.0;
  if (r.byte() != 0xcb || !r.need(8)) r.ok = false;
  if (r.ok) {
    uint64_t bits = r.be(8);
    std::memcpy(&batch_s, &bits, 8);
  }
  if (!r.ok || r.p != r.end || !y.defined()) return py::none();
  return result_cls(call_id, py::reinterpret_steal<py::object>(THPVariable_Wrap(y)), others, batch_s);
}

}  // namespace

void register_codec(py::module_& m) {
  names = Names{interned("x"),      interned("y"),      interned("call_id"), interned("epoch"),
                interned("layer"),  interned("experts"), interned("counts"), interned("replay"),
                interned("pads"),   interned("others"), interned("batch_s")};
  m.def("encode_data", &encode_data,
        "an expert call (is_call) or result -> (wire bytes, whether the frame is in them: under join_below bytes), "
        "or None");
  m.def("decode_data", &decode_data,
        "a call's or result's body (the frame table, a header of header_len bytes, one frame), made with call_cls "
        "or result_cls, its tensor a view of the body; or None");
}
