// An expert call or result from wire bytes, in one call, its tensor a view of the bytes (codec.h: the format).

#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <utility>
#include <vector>

#include "codec.h"

namespace codec {
namespace {

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

}  // namespace

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

}  // namespace codec
