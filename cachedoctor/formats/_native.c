/* Two checks --deep runs on every file of a cache, in C: the value test and the layout match.
 *
 * Both have pure-Python equivalents that define what they mean (nonfinite.holds_none and a
 * zip_templates.Template's regular expressions); these only do the same faster. The module is
 * optional: where it was not built (no compiler) or CACHEDOCTOR_NO_NATIVE is set, the Python
 * ones run, and the tests hold both to the same answers.
 *
 * Neither reads outside the buffer it is given: every range is checked against its length
 * before any byte is read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Vector code for the CPU the scan runs on, chosen at load time (GCC's function
 * multi-versioning: an AVX2 copy beside the baseline one). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#define BLOCK 4096 /* elements tested between two looks at the running answer */

/* Whether some element's magnitude bits (all but the sign bit) reach `threshold`: that is
 * exactly the NaN/Inf encodings of an IEEE-like float of that width (nonfinite.none_test);
 * with `zeros`, also whether some element's magnitude is 0 (+0, -0). With the sign bit
 * cleared both sides are non-negative as signed integers: signed compares, which the vector
 * units have (they have no unsigned ones). One function per element width, T its type. */
#define ANY_AT_OR_ABOVE(NAME, T)                                                               \
    VECTOR_CLONES static int NAME(const unsigned char *p, Py_ssize_t count, T magnitude,       \
                                  T threshold, int zeros) {                                    \
        for (Py_ssize_t i = 0; i < count; i += BLOCK) {                                        \
            Py_ssize_t end = count - i < BLOCK ? count : i + BLOCK;                            \
            T acc = 0;                                                                         \
            for (Py_ssize_t j = i; j < end; j++) {                                             \
                T x;                                                                           \
                memcpy(&x, p + sizeof(T) * j, sizeof(T));                                      \
                T m = (T)(x & magnitude);                                                      \
                acc |= (m >= threshold) | (zeros & (m == 0));                                  \
            }                                                                                  \
            if (acc)                                                                           \
                return 1;                                                                      \
        }                                                                                      \
        return 0;                                                                              \
    }

ANY_AT_OR_ABOVE(any_at_or_above_8, int8_t)
ANY_AT_OR_ABOVE(any_at_or_above_16, int16_t)
ANY_AT_OR_ABOVE(any_at_or_above_32, int32_t)
ANY_AT_OR_ABOVE(any_at_or_above_64, int64_t)

static int little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* finite(data, offset, count, itemsize, sign, threshold, zeros) -> bool
 * True when none of the `count` little-endian elements of `itemsize` bytes at byte `offset`
 * of `data` has (bits & ~sign) >= threshold, nor, with `zeros`, (bits & ~sign) == 0 (+0, -0). */
static PyObject *native_finite(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t offset, count;
    int itemsize, zeros;
    unsigned long long sign, threshold;
    if (!PyArg_ParseTuple(args, "y*nniKKp", &view, &offset, &count, &itemsize, &sign,
                          &threshold, &zeros))
        return NULL;
    if (!little_endian() || offset < 0 || count < 0 || offset > view.len ||
        (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) ||
        count > (view.len - offset) / itemsize) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "finite: elements outside the buffer, or no such width");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + offset;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1:
        bad = any_at_or_above_8(p, count, (int8_t)(uint8_t)~sign, (int8_t)threshold, zeros);
        break;
    case 2:
        bad = any_at_or_above_16(p, count, (int16_t)(uint16_t)~sign, (int16_t)threshold, zeros);
        break;
    case 4:
        bad = any_at_or_above_32(p, count, (int32_t)(uint32_t)~sign, (int32_t)threshold, zeros);
        break;
    default:
        bad = any_at_or_above_64(p, count, (int64_t)(uint64_t)~sign, (int64_t)threshold, zeros);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(!bad);
}

/* Whether every byte of p[0:n] with a mask byte of 0xFF equals the literal's byte (the
 * literal holds 0 where the mask does). */
VECTOR_CLONES static int masked_equal(const unsigned char *p, const unsigned char *literal,
                                      const unsigned char *mask, Py_ssize_t n) {
    unsigned diff = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        diff |= (unsigned)((p[i] & mask[i]) ^ literal[i]);
    return diff == 0;
}

/* span(data, at, literal, mask, prefixes, prefix_len, digits, prefix) -> bytes | None
 * The layout check of one span of a zip_templates.Template, as its regular expression makes
 * it: data[at:at + len(literal)] equals `literal` wherever `mask` is 0xFF; the `prefix_len`
 * bytes at each offset (within the span) in the tuple `prefixes` are alike, hold no "/", and
 * equal `prefix` when it is not None; every byte of each (start, end) of the tuple `digits`
 * is an ASCII digit. Returns the prefix found (`prefix` itself, or b"" when the span holds
 * none and `prefix` is None), or None when the span does not match. */
static PyObject *native_span(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, literal, mask;
    Py_ssize_t at, prefix_len;
    PyObject *prefixes, *digits, *given;
    if (!PyArg_ParseTuple(args, "y*ny*y*O!nO!O", &data, &at, &literal, &mask, &PyTuple_Type,
                          &prefixes, &prefix_len, &PyTuple_Type, &digits, &given))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = literal.len;
    const unsigned char *p = (const unsigned char *)data.buf + at;
    const unsigned char *found = NULL;
    if (mask.len != n || at < 0 || at > data.len || n > data.len - at || prefix_len < 0) {
        PyErr_SetString(PyExc_ValueError, "span: outside the buffer, or a mask of another length");
        goto done;
    }
    if (given != Py_None) {
        if (!PyBytes_Check(given) || PyBytes_GET_SIZE(given) != prefix_len) {
            PyErr_SetString(PyExc_ValueError, "span: a prefix of another length");
            goto done;
        }
        found = (const unsigned char *)PyBytes_AS_STRING(given);
    }
    if (!masked_equal(p, (const unsigned char *)literal.buf, (const unsigned char *)mask.buf, n)) {
        result = Py_None;
        goto done;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(prefixes); k++) {
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(prefixes, k));
        if (start == -1 && PyErr_Occurred())
            goto done;
        if (start < 0 || start > n || prefix_len > n - start) {
            PyErr_SetString(PyExc_ValueError, "span: a prefix outside the span");
            goto done;
        }
        if (found == NULL) {
            if (memchr(p + start, '/', (size_t)prefix_len) != NULL) {
                result = Py_None;
                goto done;
            }
            found = p + start;
        } else if (memcmp(p + start, found, (size_t)prefix_len) != 0) {
            result = Py_None;
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(digits); k++) {
        Py_ssize_t start, end;
        PyObject *range = PyTuple_GET_ITEM(digits, k);
        if (!PyArg_ParseTuple(range, "nn", &start, &end))
            goto done;
        if (start < 0 || end < start || end > n) {
            PyErr_SetString(PyExc_ValueError, "span: digits outside the span");
            goto done;
        }
        for (Py_ssize_t i = start; i < end; i++) {
            if (p[i] < '0' || p[i] > '9') {
                result = Py_None;
                goto done;
            }
        }
    }
    if (given != Py_None) {
        Py_INCREF(given);
        result = given;
    } else {
        result = PyBytes_FromStringAndSize(found ? (const char *)found : "", found ? prefix_len : 0);
    }
done:
    if (result == Py_None)
        Py_INCREF(Py_None);
    PyBuffer_Release(&data);
    PyBuffer_Release(&literal);
    PyBuffer_Release(&mask);
    return result;
}

static PyMethodDef methods[] = {
    {"finite", native_finite, METH_VARARGS,
     "finite(data, offset, count, itemsize, sign, threshold, zeros): no NaN/Inf encoding (and "
     "with zeros, no +0 or -0) among the little-endian elements"},
    {"span", native_span, METH_VARARGS,
     "span(data, at, literal, mask, prefixes, prefix_len, digits, prefix): a template span's "
     "prefix, or None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "--deep's value test and layout match, in C (optional)", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
