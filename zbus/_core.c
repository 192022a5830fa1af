/* zbus._core: the ring's per-message steps in C, for the shared-memory hot path.
 *
 * Each function does what its pure-Python twin in zbus/ring.py does, byte for byte
 * (tests/test_core.py runs both on the same inputs); zbus.ring picks this module at
 * import when it is built and ZBUS_PURE_PYTHON is not set. The words of the ring
 * are read and written with relaxed atomics between full fences, the same ordering
 * argument as the Python path (docs/architecture.md), with the fence the compiler's
 * own (mfence on x86-64, dmb ish on AArch64).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's words are little-endian; this core supports little-endian machines only"
#endif

#define ALIGN 64
#define MAX_PARTS 64 /* frames and their parts in one message, on the stack; more take the Python path */

static inline void full_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline uint64_t load_u64(const char *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_RELAXED); }

static inline uint32_t load_u32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED); }

static inline Py_ssize_t aligned(Py_ssize_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* The writable mapping behind `obj`, or -1 with an exception set. */
static int get_mapping(PyObject *obj, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

/* Bounds check of [at, at + n) inside the mapping: a bad offset is a ValueError, never a stray write. */
static int check_range(Py_buffer *view, Py_ssize_t at, Py_ssize_t n, Py_ssize_t align) {
    if (at < 0 || n < 0 || at > view->len - n || at % align) {
        PyErr_Format(PyExc_ValueError, "offset %zd (+%zd bytes) is outside the mapping or misaligned", at, n);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(fence_doc, "fence()\n--\n\nA full memory barrier: no load or store moves across it.");

static PyObject *core_fence(PyObject *self, PyObject *unused) {
    full_fence();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(store_doc,
             "store(mapping, index, value)\n--\n\n"
             "fence, write u64 word ``index`` of ``mapping``, fence: how a counter is published.");

static PyObject *core_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "store(mapping, index, value)");
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    unsigned long long value = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (get_mapping(args[0], &view, 1) < 0)
        return NULL;
    if (index < 0 || check_range(&view, index * 8, 8, 8) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "negative word index");
        PyBuffer_Release(&view);
        return NULL;
    }
    full_fence();
    __atomic_store_n((uint64_t *)((char *)view.buf + index * 8), (uint64_t)value, __ATOMIC_RELAXED);
    full_fence();
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* The buffers of `frames` (each a buffer, or a tuple of buffers written back to back),
 * flattened into parts[]; lens[f] is frame f's length. Returns the number of parts,
 * -2 when there are more than MAX_PARTS (the caller takes the Python path), -1 on error. */
static Py_ssize_t get_parts(PyObject *frames, Py_buffer *parts, Py_ssize_t *lens, Py_ssize_t nframes) {
    Py_ssize_t np = 0;
    for (Py_ssize_t f = 0; f < nframes; f++) {
        PyObject *frame = PyList_GET_ITEM(frames, f);
        int is_tuple = PyTuple_CheckExact(frame);
        Py_ssize_t count = is_tuple ? PyTuple_GET_SIZE(frame) : 1;
        lens[f] = 0;
        for (Py_ssize_t k = 0; k < count; k++) {
            if (np == MAX_PARTS)
                goto too_many;
            PyObject *part = is_tuple ? PyTuple_GET_ITEM(frame, k) : frame;
            if (PyObject_GetBuffer(part, &parts[np], PyBUF_C_CONTIGUOUS) < 0)
                goto fail;
            lens[f] += parts[np].len;
            np++;
        }
    }
    return np;
too_many:
    for (Py_ssize_t k = 0; k < np; k++)
        PyBuffer_Release(&parts[k]);
    return -2;
fail:
    for (Py_ssize_t k = 0; k < np; k++)
        PyBuffer_Release(&parts[k]);
    return -1;
}

PyDoc_STRVAR(write_message_doc,
             "write_message(mapping, at, frames, limit)\n--\n\n"
             "Write the message of ``frames`` (a list; each a buffer, or a tuple of buffers\n"
             "written back to back) at byte ``at`` of ``mapping``: header, then each frame\n"
             "64-byte aligned with zero padding. Returns its size; -1, with nothing written,\n"
             "when it is over ``limit`` bytes or has too many parts for this path.");

static PyObject *core_write_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "write_message(mapping, at, frames: list, limit)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]), limit = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *frames = args[2];
    Py_ssize_t nframes = PyList_GET_SIZE(frames);
    if (nframes > MAX_PARTS)
        return PyLong_FromLong(-1);
    Py_buffer parts[MAX_PARTS];
    Py_ssize_t lens[MAX_PARTS], offsets[MAX_PARTS];
    Py_ssize_t np = get_parts(frames, parts, lens, nframes);
    if (np == -1)
        return NULL;
    if (np == -2)
        return PyLong_FromLong(-1);
    Py_ssize_t total = 16 + 8 * nframes;
    for (Py_ssize_t f = 0; f < nframes; f++) {
        offsets[f] = aligned(total);
        total = offsets[f] + lens[f];
    }
    PyObject *result = NULL;
    Py_buffer view;
    if (total > limit) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    if (get_mapping(args[0], &view, 1) < 0)
        goto done;
    if (check_range(&view, at, total, 8) == 0) {
        char *base = (char *)view.buf + at;
        uint64_t head[2] = {(uint64_t)total, (uint64_t)nframes};
        memcpy(base, head, 16);
        for (Py_ssize_t f = 0; f < nframes; f++) {
            uint64_t n = (uint64_t)lens[f];
            memcpy(base + 16 + 8 * f, &n, 8);
        }
        Py_ssize_t end = 16 + 8 * nframes, k = 0;
        for (Py_ssize_t f = 0; f < nframes; f++) {
            memset(base + end, 0, (size_t)(offsets[f] - end));
            char *to = base + offsets[f];
            PyObject *frame = PyList_GET_ITEM(frames, f);
            Py_ssize_t count = PyTuple_CheckExact(frame) ? PyTuple_GET_SIZE(frame) : 1;
            for (Py_ssize_t c = 0; c < count; c++, k++) {
                memcpy(to, parts[k].buf, (size_t)parts[k].len);
                to += parts[k].len;
            }
            end = offsets[f] + lens[f];
        }
        result = PyLong_FromSsize_t(total);
    }
    PyBuffer_Release(&view);
done:
    for (Py_ssize_t k = 0; k < np; k++)
        PyBuffer_Release(&parts[k]);
    return result;
}

PyDoc_STRVAR(read_message_doc,
             "read_message(mapping, at, limit)\n--\n\n"
             "Copy the message at byte ``at`` of ``mapping`` into a new bytearray and return\n"
             "its frames (memoryviews of it); None, with nothing read past the size word,\n"
             "when it is over ``limit`` bytes. ValueError when its header does not describe\n"
             "exactly its size.");

static PyObject *frames_of(PyObject *out, const uint64_t *lens, Py_ssize_t nframes) {
    PyObject *whole = PyMemoryView_FromObject(out);
    if (whole == NULL)
        return NULL;
    PyObject *list = PyList_New(nframes);
    Py_ssize_t pos = 16 + 8 * nframes;
    for (Py_ssize_t f = 0; list != NULL && f < nframes; f++) {
        pos = aligned(pos);
        PyObject *start = PyLong_FromSsize_t(pos), *stop = PyLong_FromSsize_t(pos + (Py_ssize_t)lens[f]);
        PyObject *slice = start && stop ? PySlice_New(start, stop, NULL) : NULL;
        PyObject *item = slice ? PyObject_GetItem(whole, slice) : NULL;
        Py_XDECREF(slice);
        Py_XDECREF(start);
        Py_XDECREF(stop);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, f, item);
        pos += (Py_ssize_t)lens[f];
    }
    Py_DECREF(whole);
    return list;
}

static PyObject *core_read_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "read_message(mapping, at, limit)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]), limit = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (get_mapping(args[0], &view, 0) < 0)
        return NULL;
    PyObject *result = NULL, *out = NULL;
    if (check_range(&view, at, 16, 8) < 0)
        goto done;
    const char *base = (const char *)view.buf + at;
    uint64_t total = load_u64(base), nframes = load_u64(base + 8);
    if (total > (uint64_t)limit) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (check_range(&view, at, (Py_ssize_t)total, 8) < 0)
        goto done;
    /* The header must lay out to exactly `total` bytes, as the writer made it. */
    uint64_t end = 16 + 8 * nframes;
    int ok = total >= 16 && nframes <= (total - 16) / 8;
    for (uint64_t f = 0; ok && f < nframes; f++) {
        uint64_t n;
        memcpy(&n, base + 16 + 8 * f, 8);
        end = (end + ALIGN - 1) / ALIGN * ALIGN;
        ok = n <= total && end <= total - n;
        end += n;
    }
    if (!ok || end != total) {
        PyErr_Format(PyExc_ValueError, "corrupt message header");
        goto done;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL)
        goto done;
    memcpy(PyByteArray_AS_STRING(out), base, (size_t)total);
    result = frames_of(out, (const uint64_t *)(PyByteArray_AS_STRING(out) + 16), (Py_ssize_t)nframes);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(poll_doc,
             "poll(mapping, index, above, stops, spin_s, yield_s)\n--\n\n"
             "Wait, without the GIL, until u64 word ``index`` of ``mapping`` is over ``above``\n"
             "or any u32 word in the tuple ``stops`` is nonzero: spin ``spin_s``, then call\n"
             "sched_yield until ``yield_s`` more have passed. Returns whether the wait ended\n"
             "that way (False: the time ran out; the caller then sleeps on its doorbell).");

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int ready(const char *base, Py_ssize_t index, uint64_t above, const Py_ssize_t *stops, Py_ssize_t nstops) {
    if (load_u64(base + 8 * index) > above)
        return 1;
    for (Py_ssize_t s = 0; s < nstops; s++)
        if (load_u32(base + 4 * stops[s]))
            return 1;
    return 0;
}

static PyObject *core_poll(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "poll(mapping, index, above, stops: tuple, spin_s, yield_s)");
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    unsigned long long above = PyLong_AsUnsignedLongLong(args[2]);
    double spin_s = PyFloat_AsDouble(args[4]), yield_s = PyFloat_AsDouble(args[5]);
    Py_ssize_t nstops = PyTuple_GET_SIZE(args[3]), stops[8];
    if (nstops > 8) {
        PyErr_SetString(PyExc_ValueError, "at most 8 stop words");
        return NULL;
    }
    for (Py_ssize_t s = 0; s < nstops; s++)
        stops[s] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[3], s));
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (get_mapping(args[0], &view, 0) < 0)
        return NULL;
    int bad = index < 0 || check_range(&view, index * 8, 8, 8) < 0;
    for (Py_ssize_t s = 0; !bad && s < nstops; s++)
        bad = stops[s] < 0 || check_range(&view, stops[s] * 4, 4, 4) < 0;
    if (bad) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "negative word index");
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *base = (const char *)view.buf;
    int got = 0;
    Py_BEGIN_ALLOW_THREADS
    double now = now_s(), spin_end = now + spin_s, yield_end;
    while (!(got = ready(base, index, above, stops, nstops)) && now < spin_end)
        now = now_s();
    yield_end = now + yield_s;
    while (!got && now < yield_end) {
        sched_yield();
        got = ready(base, index, above, stops, nstops);
        now = now_s();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyBool_FromLong(got);
}

static PyMethodDef core_methods[] = {
    {"fence", core_fence, METH_NOARGS, fence_doc},
    {"store", (PyCFunction)(void (*)(void))core_store, METH_FASTCALL, store_doc},
    {"write_message", (PyCFunction)(void (*)(void))core_write_message, METH_FASTCALL, write_message_doc},
    {"read_message", (PyCFunction)(void (*)(void))core_read_message, METH_FASTCALL, read_message_doc},
    {"poll", (PyCFunction)(void (*)(void))core_poll, METH_FASTCALL, poll_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "zbus._core", "The ring's per-message steps in C (see zbus.ring).", -1, core_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModule_Create(&core_module); }
