/* zbus._core: the ring's per-message steps in C, for the shared-memory hot path.
 *
 * Each function does what its pure-Python twin in zbus/ring.py does, byte for byte
 * (tests/test_core.py runs both on the same inputs); zbus.ring picks this module at
 * import when it is built and ZBUS_PURE_PYTHON is not set. The words of the ring
 * are read and written with relaxed atomics between full fences, the same ordering
 * argument as the Python path (docs/architecture.md), with the fence the compiler's
 * own (mfence on x86-64, dmb ish on AArch64).
 */
#define _GNU_SOURCE /* dl_iterate_phdr, RTLD_NOLOAD */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's words are little-endian; this core supports little-endian machines only"
#endif

_Static_assert(sizeof(Py_ssize_t) == 8, "the header walk and the ring's offsets assume 64-bit sizes");

#define ALIGN 64
#define MAX_ENVELOPE 65536 /* zbus.protocol.MAX_ENVELOPE: a longer one is no call */
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
 * flattened into parts[]; lens[f] is frame f's length, counts[f] its number of parts
 * (kept here: an exporter's code may change the list or a tuple meanwhile). Returns
 * the number of parts, -2 when there are more than MAX_PARTS or a part is no
 * contiguous buffer (the caller takes the Python path, which copies a strided view),
 * -1 on error. */
static Py_ssize_t get_parts(PyObject *frames, Py_buffer *parts, Py_ssize_t *lens, Py_ssize_t *counts,
                            Py_ssize_t nframes) {
    Py_ssize_t np = 0;
    for (Py_ssize_t f = 0; f < nframes && f < PyList_GET_SIZE(frames); f++) {
        PyObject *frame = PyList_GET_ITEM(frames, f);
        Py_INCREF(frame);
        int is_tuple = PyTuple_CheckExact(frame);
        Py_ssize_t count = is_tuple ? PyTuple_GET_SIZE(frame) : 1;
        lens[f] = 0;
        counts[f] = count;
        for (Py_ssize_t k = 0; k < count; k++) {
            if (np == MAX_PARTS) {
                Py_DECREF(frame);
                goto too_many;
            }
            PyObject *part = is_tuple ? PyTuple_GET_ITEM(frame, k) : frame;
            if (PyObject_GetBuffer(part, &parts[np], PyBUF_C_CONTIGUOUS) < 0) {
                Py_DECREF(frame);
                /* (numpy says ValueError where memoryview says BufferError: the Python
                 * path then answers as its twin does) */
                if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError))
                    goto fail;
                PyErr_Clear();
                goto too_many;
            }
            lens[f] += parts[np].len;
            np++;
        }
        Py_DECREF(frame);
    }
    if (PyList_GET_SIZE(frames) != nframes)
        goto too_many;
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
    Py_ssize_t lens[MAX_PARTS], counts[MAX_PARTS], offsets[MAX_PARTS];
    Py_ssize_t np = get_parts(frames, parts, lens, counts, nframes);
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
            for (Py_ssize_t c = 0; c < counts[f]; c++, k++) {
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
    uint64_t total = load_u64(base);
    if (total > (uint64_t)limit) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (check_range(&view, at, (Py_ssize_t)total, 8) < 0)
        goto done;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL)
        goto done;
    memcpy(PyByteArray_AS_STRING(out), base, (size_t)total);
    /* The copy's header must lay out to exactly `total` bytes, as the writer made it
       (checked on the copy: a writer that changed the ring meanwhile cannot slip by). */
    const char *copy = PyByteArray_AS_STRING(out);
    uint64_t nframes = 0;
    if (total >= 16)
        memcpy(&nframes, copy + 8, 8);
    int ok = total >= 16 && nframes <= (total - 16) / 8;
    uint64_t end = 16 + 8 * (ok ? nframes : 0);
    for (uint64_t f = 0; ok && f < nframes; f++) {
        uint64_t n;
        memcpy(&n, copy + 16 + 8 * f, 8);
        end = (end + ALIGN - 1) / ALIGN * ALIGN;
        ok = n <= total && end <= total - n;
        end += n;
    }
    if (!ok || end != total) {
        PyErr_Format(PyExc_ValueError, "corrupt message header");
        goto done;
    }
    result = frames_of(out, (const uint64_t *)(copy + 16), (Py_ssize_t)nframes);
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
             "that way (False: the time ran out; the caller then sleeps on its doorbell). In the\n"
             "main thread a signal's handlers run within SIGNAL_CHECK_S, as between the Python\n"
             "twin's steps: Ctrl-C ends the poll (its exception raised).");

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define SIGNAL_CHECK_S 0.005
static unsigned long main_thread_ident; /* threading.main_thread().ident, at import */

/* A fork's child runs on in the thread that forked: Python makes it the main one. */
static void forked_child(void) {
    main_thread_ident = PyThread_get_thread_ident();
}

/* For a wait without the GIL in the main thread: every SIGNAL_CHECK_S, take the GIL
 * (`save`: the wait's thread state) and run a signal's handlers, as they run between
 * the Python twin's steps. Whether one raised (Ctrl-C): the wait then ends, raising it. */
static int signal_raised(PyThreadState **save, double now, double *check_at) {
    if (now < *check_at)
        return 0;
    *check_at = now + SIGNAL_CHECK_S;
    PyEval_RestoreThread(*save);
    int raised = PyErr_CheckSignals() < 0;
    *save = PyEval_SaveThread();
    return raised;
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
    int got = 0, interrupted = 0, signals = PyThread_get_thread_ident() == main_thread_ident;
    Py_BEGIN_ALLOW_THREADS
    double now = now_s(), spin_end = now + spin_s, yield_end, check_at = now + SIGNAL_CHECK_S;
    for (int yielding = 0; !got && !interrupted; ) {
        got = ready(base, index, above, stops, nstops);
        if (got)
            break;
        if (!yielding && !(now < spin_end)) { /* (a NaN ends it, as in the twin) */
            yielding = 1;
            yield_end = now + yield_s;
        }
        if (yielding && !(now < yield_end))
            break;
        if (yielding)
            sched_yield();
        now = now_s();
        interrupted = signals && signal_raised(&_save, now, &check_at);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (interrupted)
        return NULL;
    return PyBool_FromLong(got);
}


/* --- The agent's relay: one call from a ZeroMQ socket straight into the ring ------------------
 *
 * libzmq is the one pyzmq loaded (found among the loaded objects, not linked: zbus builds
 * without its headers); the socket is pyzmq's own handle (Socket.underlying), used only by
 * the thread that calls here. zmq_msg_t is 64 opaque bytes in every libzmq 4.x. */

typedef struct { unsigned char _[64]; } __attribute__((aligned(8))) zmsg_t;
#define ZMQ_DONTWAIT_FLAG 1
static int (*z_msg_init)(zmsg_t *);
static int (*z_msg_recv)(zmsg_t *, void *, int);
static int (*z_msg_close)(zmsg_t *);
static void *(*z_msg_data)(zmsg_t *);
static size_t (*z_msg_size)(const zmsg_t *);
static int (*z_msg_more)(const zmsg_t *);
static int (*z_errno)(void);
static int (*z_getsockopt)(void *, int, void *, size_t *);
static const char *(*z_msg_gets)(const zmsg_t *, const char *);
static int (*z_poll)(void *, int, long);
static int zmq_bound; /* 1: found (looked for again until then: zmq may be imported later) */

static int find_libzmq(struct dl_phdr_info *info, size_t size, void *found) {
    if (info->dlpi_name != NULL && strstr(info->dlpi_name, "libzmq") != NULL) {
        *(void **)found = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
        return *(void **)found != NULL;
    }
    return 0;
}

static int bind_libzmq(void) {
    if (zmq_bound)
        return zmq_bound;
    void *lib = NULL;
    dl_iterate_phdr(find_libzmq, &lib);
    if (lib == NULL)
        return -1;
    *(void **)&z_msg_init = dlsym(lib, "zmq_msg_init");
    *(void **)&z_msg_recv = dlsym(lib, "zmq_msg_recv");
    *(void **)&z_msg_close = dlsym(lib, "zmq_msg_close");
    *(void **)&z_msg_data = dlsym(lib, "zmq_msg_data");
    *(void **)&z_msg_size = dlsym(lib, "zmq_msg_size");
    *(void **)&z_msg_more = dlsym(lib, "zmq_msg_more");
    *(void **)&z_errno = dlsym(lib, "zmq_errno");
    *(void **)&z_getsockopt = dlsym(lib, "zmq_getsockopt");
    *(void **)&z_msg_gets = dlsym(lib, "zmq_msg_gets");
    *(void **)&z_poll = dlsym(lib, "zmq_poll");
    if (z_msg_init && z_msg_recv && z_msg_close && z_msg_data && z_msg_size && z_msg_more && z_errno
        && z_getsockopt && z_msg_gets && z_poll)
        zmq_bound = 1;
    return zmq_bound == 1 ? 1 : -1;
}

/* zmq_msg_recv without waiting, again where a signal interrupted it: libzmq answers EINTR
 * when one lands as it processes its commands, even between the parts of a message (the
 * part is still there: taken by the next try). Bounded: a storm of signals fails it. */
static int recv_part(zmsg_t *msg, void *sock) {
    for (int tries = 0; tries < 1000; tries++) {
        int rc = z_msg_recv(msg, sock, ZMQ_DONTWAIT_FLAG);
        if (rc >= 0 || z_errno() != EINTR)
            return rc;
    }
    return -1;
}

/* 0 where libzmq is bound, else -1 with the error set (for the functions that call it). */
static int require_libzmq(void) {
    if (bind_libzmq() == 1)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "libzmq is not loaded: import zmq first");
    return -1;
}

PyDoc_STRVAR(relay_ready_doc,
             "relay_ready()\n--\n\n"
             "Whether relay_one can run: the libzmq that pyzmq loaded (import zmq first) was found.");

static PyObject *core_relay_ready(PyObject *self, PyObject *unused) { return PyBool_FromLong(bind_libzmq() == 1); }

/* A msgpack integer at p[0..n): its bytes used (0: not an integer). Unsigned formats only
 * when `unsigned_only`; the value in *value (signed ones as two's complement). */
static size_t mp_int(const unsigned char *p, size_t n, int unsigned_only, uint64_t *value) {
    if (n == 0)
        return 0;
    unsigned char b = p[0];
    if (b <= 0x7f || (!unsigned_only && b >= 0xe0)) {
        *value = b <= 0x7f ? b : (uint64_t)(int64_t)(int8_t)b;
        return 1;
    }
    size_t width;
    int is_signed = 0;
    switch (b) {
    case 0xcc: width = 1; break;
    case 0xcd: width = 2; break;
    case 0xce: width = 4; break;
    case 0xcf: width = 8; break;
    case 0xd0: width = 1; is_signed = 1; break;
    case 0xd1: width = 2; is_signed = 1; break;
    case 0xd2: width = 4; is_signed = 1; break;
    case 0xd3: width = 8; is_signed = 1; break;
    default: return 0;
    }
    if ((is_signed && unsigned_only) || n < 1 + width)
        return 0;
    uint64_t v = 0;
    for (size_t k = 0; k < width; k++)
        v = v << 8 | p[1 + k];
    if (is_signed && width < 8 && (v >> (8 * width - 1)))
        v |= ~(uint64_t)0 << (8 * width); /* sign-extend */
    *value = v;
    return 1 + width;
}

/* Whether p[0..n) is exactly the msgpack of a call envelope [1, seq, method, int, int, int]
 * with an ASCII method name; its seq in *seq. Anything else (or an unusual encoding of one)
 * goes to the Python path, which judges it with zbus.protocol.read_envelope. */
static int call_envelope_seq(const unsigned char *p, size_t n, uint64_t *seq) {
    if (n < 2 || n > MAX_ENVELOPE || p[0] != 0x96 || p[1] != 0x01)
        return 0;
    size_t at = 2, used, len;
    uint64_t ignored;
    if ((used = mp_int(p + at, n - at, 1, seq)) == 0)
        return 0;
    at += used;
    if (at >= n)
        return 0;
    unsigned char b = p[at];
    if (b >= 0xa0 && b <= 0xbf) {
        len = b & 0x1f;
        at += 1;
    } else if (b == 0xd9 && at + 2 <= n) {
        len = p[at + 1];
        at += 2;
    } else if (b == 0xda && at + 3 <= n) {
        len = (size_t)p[at + 1] << 8 | p[at + 2];
        at += 3;
    } else {
        return 0;
    }
    if (len > n - at)
        return 0;
    for (size_t k = 0; k < len; k++)
        if (p[at + k] & 0x80)
            return 0;
    at += len;
    for (int k = 0; k < 3; k++) {
        if ((used = mp_int(p + at, n - at, 0, &ignored)) == 0)
            return 0;
        at += used;
    }
    return at == n;
}

PyDoc_STRVAR(wait_readable_doc,
             "wait_readable(socket, seconds)\n--\n\n"
             "Call sched_yield, without the GIL, until the ZeroMQ socket at address ``socket``\n"
             "has a message or ``seconds`` have passed: whether it has one. In the main thread a\n"
             "signal's handlers run within SIGNAL_CHECK_S (Ctrl-C ends the wait).");

static PyObject *core_wait_readable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_readable(socket, seconds)");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    double seconds = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (require_libzmq() < 0)
        return NULL;
    int events = 0, rc = 0, interrupted = 0, signals = PyThread_get_thread_ident() == main_thread_ident;
    Py_BEGIN_ALLOW_THREADS
    double now = now_s(), end = now + seconds, check_at = now + SIGNAL_CHECK_S;
    do {
        size_t size = sizeof events;
        rc = z_getsockopt(sock, 15 /* ZMQ_EVENTS */, &events, &size);
        if (rc < 0 || events & 1 /* ZMQ_POLLIN */)
            break;
        sched_yield();
        now = now_s();
        interrupted = signals && signal_raised(&_save, now, &check_at);
    } while (!interrupted && now < end);
    Py_END_ALLOW_THREADS
    if (interrupted)
        return NULL;
    if (rc < 0) {
        errno = z_errno();
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(events & 1);
}

static void close_parts(zmsg_t *parts, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++)
        z_msg_close(&parts[k]);
}

PyDoc_STRVAR(relay_one_doc,
             "relay_one(socket, mapping, at, limit, topic, seq)\n--\n\n"
             "Receive one message from the ZeroMQ socket at address ``socket`` without waiting\n"
             "and without the GIL. A call on ``topic`` whose envelope numbers it ``seq`` and whose\n"
             "other frames lay out in ``limit`` bytes is written at byte ``at`` of ``mapping``,\n"
             "as write_message writes them (not published): returns its size. Any other message:\n"
             "its parts as a list of bytes. Nothing to receive: None.");

static PyObject *core_relay_one(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "relay_one(socket, mapping, at, limit, topic: bytes, seq)");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t at = PyLong_AsSsize_t(args[2]), limit = PyLong_AsSsize_t(args[3]);
    unsigned long long want = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (require_libzmq() < 0)
        return NULL;
    Py_buffer view;
    if (get_mapping(args[1], &view, 1) < 0)
        return NULL;
    const char *topic = PyBytes_AS_STRING(args[4]);
    size_t topic_len = (size_t)PyBytes_GET_SIZE(args[4]);
    zmsg_t parts[MAX_PARTS + 1];
    Py_ssize_t n = 0, total = -1;
    int more = 0, err = 0, range_ok = 0;
    Py_BEGIN_ALLOW_THREADS
    z_msg_init(&parts[0]);
    if (recv_part(&parts[0], sock) < 0) {
        err = z_errno();
        z_msg_close(&parts[0]);
    } else {
        n = 1;
        more = z_msg_more(&parts[0]);
        while (more && n < MAX_PARTS + 1) { /* the parts of a message arrive together */
            z_msg_init(&parts[n]);
            if (recv_part(&parts[n], sock) < 0) {
                err = z_errno();
                z_msg_close(&parts[n]);
                break;
            }
            more = z_msg_more(&parts[n++]);
        }
        uint64_t seq;
        if (!err && !more && n >= 2 && z_msg_size(&parts[0]) == topic_len
            && memcmp(z_msg_data(&parts[0]), topic, topic_len) == 0
            && call_envelope_seq(z_msg_data(&parts[1]), z_msg_size(&parts[1]), &seq) && seq == want) {
            Py_ssize_t nframes = n - 1, offsets[MAX_PARTS];
            Py_ssize_t size = 16 + 8 * nframes;
            for (Py_ssize_t f = 0; f < nframes; f++) {
                offsets[f] = aligned(size);
                size = offsets[f] + (Py_ssize_t)z_msg_size(&parts[f + 1]);
            }
            range_ok = at >= 0 && at % 8 == 0 && size <= limit && at <= view.len - size;
            if (range_ok) {
                char *base = (char *)view.buf + at;
                uint64_t head[2] = {(uint64_t)size, (uint64_t)nframes};
                memcpy(base, head, 16);
                Py_ssize_t end = 16 + 8 * nframes;
                for (Py_ssize_t f = 0; f < nframes; f++) {
                    uint64_t len = (uint64_t)z_msg_size(&parts[f + 1]);
                    memcpy(base + 16 + 8 * f, &len, 8);
                    memset(base + end, 0, (size_t)(offsets[f] - end));
                    memcpy(base + offsets[f], z_msg_data(&parts[f + 1]), (size_t)len);
                    end = offsets[f] + (Py_ssize_t)len;
                }
                total = size;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (n == 0) {
        if (err == EAGAIN)
            Py_RETURN_NONE;
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *result = NULL;
    if (total >= 0) {
        result = PyLong_FromSsize_t(total);
    } else if (err) { /* a message cut short: never happens to a multipart message in ZeroMQ */
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyList_New(n);
        for (Py_ssize_t k = 0; result != NULL && k < n; k++) {
            PyObject *b = PyBytes_FromStringAndSize(z_msg_data(&parts[k]), (Py_ssize_t)z_msg_size(&parts[k]));
            if (b == NULL)
                Py_CLEAR(result);
            else
                PyList_SET_ITEM(result, k, b);
        }
        while (result != NULL && more) { /* more parts than fit on the stack */
            zmsg_t extra;
            z_msg_init(&extra);
            if (recv_part(&extra, sock) < 0) {
                errno = z_errno();
                z_msg_close(&extra);
                Py_CLEAR(result);
                PyErr_SetFromErrno(PyExc_OSError);
                break;
            }
            more = z_msg_more(&extra);
            PyObject *b = PyBytes_FromStringAndSize(z_msg_data(&extra), (Py_ssize_t)z_msg_size(&extra));
            z_msg_close(&extra);
            if (b == NULL || PyList_Append(result, b) < 0)
                Py_CLEAR(result);
            Py_XDECREF(b);
        }
    }
    close_parts(parts, n);
    return result;
}

/* --- The leader's reply reader: one message off its PULL socket, whole, with no Python step ---
 *
 * pyzmq runs a pending signal's handler inside its receive, after a frame left ZeroMQ's
 * queue, and drops the frame when the handler raises (a Ctrl-C lost a reply). Here every
 * part is taken without the GIL, and the message is put in the caller's list before this
 * returns: a handler that raises as it returns finds the message already kept. */

typedef struct {
    PyObject_HEAD
    zmsg_t msg;
} PartObject;

static void part_dealloc(PartObject *self) {
    z_msg_close(&self->msg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int part_getbuffer(PartObject *self, Py_buffer *view, int flags) {
    /* (writable, as pyzmq's frames are: the codec lends a tensor a writable buffer in place) */
    return PyBuffer_FillInfo(view, (PyObject *)self, z_msg_data(&self->msg), (Py_ssize_t)z_msg_size(&self->msg),
                             0, flags);
}

static PyBufferProcs part_as_buffer = {(getbufferproc)part_getbuffer, NULL};

static PyTypeObject PartType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zbus._core.Part",
    .tp_basicsize = sizeof(PartObject),
    .tp_dealloc = (destructor)part_dealloc,
    .tp_as_buffer = &part_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received ZeroMQ message part, read through its buffer; freed with the last view.",
};

#define COPY_BELOW 65536 /* a smaller part is copied (pyzmq's threshold, for the same trade) */

/* The part as a writable memoryview: copied into a bytearray if small, else the message moved
 * into a Part. The message is closed (or moved) either way. */
static PyObject *view_of_part(zmsg_t *msg) {
    size_t size = z_msg_size(msg);
    PyObject *owner;
    if (size < COPY_BELOW) {
        owner = PyByteArray_FromStringAndSize(z_msg_data(msg), (Py_ssize_t)size);
        z_msg_close(msg);
    } else {
        owner = (PyObject *)PyObject_New(PartObject, &PartType);
        if (owner == NULL)
            z_msg_close(msg);
        else
            memcpy(&((PartObject *)owner)->msg, msg, sizeof *msg); /* a move, as zmq_msg_move does */
    }
    if (owner == NULL)
        return NULL;
    PyObject *view = PyMemoryView_FromObject(owner);
    Py_DECREF(owner);
    return view;
}

PyDoc_STRVAR(take_message_doc,
             "take_message(socket, max_parts, user_id, into)\n--\n\n"
             "Take one message off the ZeroMQ socket at address ``socket`` without waiting and\n"
             "without the GIL, its first ``max_parts`` parts at most (the rest stays on the\n"
             "socket), and append ``(parts, whole, uid)`` to the list ``into`` before returning:\n"
             "``parts`` a list of writable memoryviews, ``whole`` whether that is all of it,\n"
             "``uid`` its first part's User-Id if ``user_id`` (else None). Returns whether\n"
             "there was one.");

static PyObject *core_take_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "take_message(socket, max_parts, user_id, into: list)");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t max_parts = PyLong_AsSsize_t(args[1]);
    int want_uid = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred() || want_uid < 0)
        return NULL;
    if (max_parts < 1) {
        PyErr_SetString(PyExc_ValueError, "max_parts must be at least 1");
        return NULL;
    }
    if (require_libzmq() < 0)
        return NULL;
    zmsg_t stack[MAX_PARTS], *parts = stack;
    Py_ssize_t n = 0, cap = MAX_PARTS;
    int more = 1, err = 0, no_memory = 0;
    const char *uid = NULL;
    Py_BEGIN_ALLOW_THREADS
    while (more && n < max_parts) { /* the parts of a message arrive together: none waits */
        if (n == cap) {
            Py_ssize_t grown = cap * 2 < max_parts ? cap * 2 : max_parts;
            zmsg_t *bigger = parts == stack ? malloc(grown * sizeof *parts) : realloc(parts, grown * sizeof *parts);
            if (bigger == NULL) {
                no_memory = 1;
                break;
            }
            if (parts == stack)
                memcpy(bigger, stack, sizeof stack); /* moved, as zmq_msg_move does */
            parts = bigger, cap = grown;
        }
        z_msg_init(&parts[n]);
        if (recv_part(&parts[n], sock) < 0) {
            err = z_errno();
            z_msg_close(&parts[n]);
            break;
        }
        more = z_msg_more(&parts[n++]);
    }
    if (n > 0 && want_uid)
        uid = z_msg_gets(&parts[0], "User-Id");
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (n == 0 && err == EAGAIN) {
        result = Py_NewRef(Py_False);
    } else if (n == 0 || err || no_memory) { /* (a message cut short never happens in ZeroMQ) */
        if (no_memory) {
            PyErr_NoMemory();
        } else {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
    } else {
        /* (the User-Id's text is the message's: read before the parts are closed) */
        PyObject *who = uid != NULL ? PyUnicode_DecodeUTF8(uid, (Py_ssize_t)strlen(uid), "surrogateescape")
                                    : Py_NewRef(Py_None);
        PyObject *list = who != NULL ? PyList_New(n) : NULL, *entry = NULL;
        Py_ssize_t k = 0;
        for (; list != NULL && k < n; k++) {
            PyObject *view = view_of_part(&parts[k]);
            if (view == NULL) {
                Py_CLEAR(list);
                k++;
                break;
            }
            PyList_SET_ITEM(list, k, view);
        }
        for (; k < n; k++) /* (after a failure: those not made into views) */
            z_msg_close(&parts[k]);
        n = 0;
        if (list != NULL)
            entry = PyTuple_Pack(3, list, more ? Py_False : Py_True, who);
        if (entry != NULL && PyList_Append(args[3], entry) == 0)
            result = Py_NewRef(Py_True);
        Py_XDECREF(entry);
        Py_XDECREF(list);
        Py_XDECREF(who);
    }
    for (Py_ssize_t k = 0; k < n; k++)
        z_msg_close(&parts[k]);
    if (parts != stack)
        free(parts);
    return result;
}

PyDoc_STRVAR(wait_message_doc,
             "wait_message(socket, seconds)\n--\n\n"
             "Wait, without the GIL, until the ZeroMQ socket at address ``socket`` has a message\n"
             "or ``seconds`` have passed (zmq_poll): whether it has one. A signal's handlers run\n"
             "as it interrupts the wait (Ctrl-C ends it, raising).");

static PyObject *core_wait_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_message(socket, seconds)");
        return NULL;
    }
    struct { void *socket; int fd; short events, revents; } item = {PyLong_AsVoidPtr(args[0]), 0, 1, 0};
    double seconds = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (require_libzmq() < 0)
        return NULL;
    double end = now_s() + seconds;
    for (;;) {
        double left = end - now_s();
        long ms = left > 0 ? (long)(left * 1000 + 0.999) : 0;
        int rc, err;
        Py_BEGIN_ALLOW_THREADS
        rc = z_poll(&item, 1, ms);
        err = rc < 0 ? z_errno() : 0;
        Py_END_ALLOW_THREADS
        if (rc >= 0)
            return PyBool_FromLong(item.revents & 1);
        if (err != EINTR) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (PyErr_CheckSignals() < 0)
            return NULL;
        if (ms == 0)
            Py_RETURN_FALSE;
    }
}

PyDoc_STRVAR(bell_recv_doc,
             "bell_recv(fd)\n--\n\n"
             "One recv(2) on the blocking datagram socket ``fd``, without the GIL, for as long as\n"
             "its receive timeout (SO_RCVTIMEO): True if a ring came, False if the time ran out,\n"
             "None if a signal came first (its Python handlers have run). Python's own recv\n"
             "retries after a signal with the whole timeout again: a signal every 0.1 s made a\n"
             "sleep of 0.3 s endless.");

static PyObject *core_bell_recv(PyObject *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    char ring[16];
    ssize_t n;
    int err;
    Py_BEGIN_ALLOW_THREADS
    n = recv((int)fd, ring, sizeof ring, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (n >= 0)
        Py_RETURN_TRUE;
    if (err == EAGAIN || err == EWOULDBLOCK)
        Py_RETURN_FALSE;
    if (err == EINTR) {
        if (PyErr_CheckSignals() < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* --- the codec's header walk (zbus.codec._walk_py, item by item in Python) --- */

enum { WALK_OK, WALK_TRUNCATED, WALK_OVER_BUDGET, WALK_BODY_LENGTH, WALK_EXT_CODE, WALK_RESERVED,
       WALK_PAST_END, WALK_TOO_DEEP };
#define WALK_MAX_DEPTH 64

/* msgpack's type bytes: the size of an item that is a type byte and a fixed payload, else 0 */
static unsigned char walk_fixed[256];

static void walk_init(void) {
    for (int b = 0; b < 256; b++) {
        int n = 0;
        if (b < 0x80 || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            n = 1;
        else if (b >= 0xa0 && b <= 0xbf)
            n = 1 + (b & 0x1f);
        else if (b == 0xca || b == 0xce || b == 0xd2)
            n = 5;
        else if (b == 0xcb || b == 0xcf || b == 0xd3)
            n = 9;
        else if (b == 0xcc || b == 0xd0)
            n = 2;
        else if (b == 0xcd || b == 0xd1)
            n = 3;
        walk_fixed[b] = (unsigned char)n;
    }
}

/* A big-endian count of `w` bytes at `p`, of those before `end` only (as Python's slice). */
static uint64_t walk_count(const unsigned char *d, Py_ssize_t p, int w, Py_ssize_t end) {
    uint64_t v = 0;
    for (int i = 0; i < w && p + i < end; i++)
        v = v << 8 | d[p + i];
    return v;
}

static int walk_ext_code(int c) { return c >= 1 && c <= 7; }

/* The walk itself: WALK_OK with *spent, or why not (*reserved: the type byte). */
static int walk(const unsigned char *d, Py_ssize_t end, long long budget, long long *spent_out, int *reserved) {
    Py_ssize_t pos = 0, body_end = -1;
    uint64_t left = 1;
    long long spent = 0;
    struct { uint64_t left; Py_ssize_t body_end; } stack[WALK_MAX_DEPTH];
    int depth = 0;
    for (;;) {
        while (left) { /* scalars */
            if (pos >= end)
                return WALK_TRUNCATED;
            int size = walk_fixed[d[pos]];
            if (!size)
                break;
            if (size > 1)
                spent += 48 + 2 * size;
            pos += size;
            left--;
        }
        if (!left) {
            if (body_end >= 0 && pos != body_end)
                return WALK_BODY_LENGTH;
            if (!depth) {
                if (spent > budget)
                    return WALK_OVER_BUDGET;
                *spent_out = spent;
                return WALK_OK;
            }
            depth--;
            left = stack[depth].left;
            body_end = stack[depth].body_end;
            continue;
        }
        int b = d[pos];
        left--;
        uint64_t items;
        Py_ssize_t inner_end = -1;
        int w = b == 0xc4 || b == 0xd9 ? 1 : b == 0xc5 || b == 0xda ? 2 : b == 0xc6 || b == 0xdb ? 4 : 0;
        if (w) { /* bin, str */
            uint64_t n = walk_count(d, pos + 1, w, end);
            pos += 1 + w + (Py_ssize_t)n;
            spent += 56 + 2 * (long long)n;
            continue;
        }
        if (b >= 0x80 && b <= 0x9f) { /* fixmap, fixarray */
            items = (uint64_t)(b & 0x0f) * (b < 0x90 ? 2 : 1);
            pos += 1;
            spent += b < 0x90 ? 160 + 24 * (long long)items : 64 + 16 * (long long)items;
        } else if (b >= 0xdc && b <= 0xdf) { /* array16/32, map16/32 */
            int cw = b == 0xdc || b == 0xde ? 2 : 4, each = b >= 0xde ? 2 : 1;
            items = walk_count(d, pos + 1, cw, end) * each;
            pos += 1 + cw;
            spent += each == 2 ? 160 + 24 * (long long)items : 64 + 16 * (long long)items;
        } else if ((b >= 0xd4 && b <= 0xd8) || (b >= 0xc7 && b <= 0xc9)) { /* fixext, ext */
            int ew = b == 0xc7 ? 1 : b == 0xc8 ? 2 : b == 0xc9 ? 4 : 0;
            uint64_t size = ew ? walk_count(d, pos + 1, ew, end) : (uint64_t)1 << (b - 0xd4);
            if (pos + 1 + ew >= end)
                return WALK_TRUNCATED;
            int code = d[pos + 1 + ew];
            if (!walk_ext_code(code))
                return WALK_EXT_CODE;
            items = 1;
            pos += 2 + ew;
            inner_end = pos + (Py_ssize_t)size;
            spent += code == 2 ? 1280 : code == 3 ? 640 : code == 4 ? 304 : 64;
        } else {
            *reserved = b;
            return WALK_RESERVED;
        }
        if (items > (uint64_t)((inner_end < 0 ? end : inner_end) - pos) || (inner_end < 0 ? end : inner_end) < pos)
            return WALK_PAST_END;
        if (depth >= WALK_MAX_DEPTH)
            return WALK_TOO_DEEP;
        if (spent > budget)
            return WALK_OVER_BUDGET;
        stack[depth].left = left;
        stack[depth].body_end = body_end;
        depth++;
        left = items;
        body_end = inner_end;
    }
}

PyDoc_STRVAR(walk_doc,
             "walk(data, budget)\n--\n\n"
             "zbus.codec._walk_py on the bytes ``data``, without the GIL: ``(0, spent)``, or\n"
             "``(why, type byte)`` where it refuses the header (see zbus.codec._walk).");

static PyObject *core_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "walk(data, budget)");
        return NULL;
    }
    long long budget = PyLong_AsLongLong(args[1]);
    if (budget == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    long long spent = 0;
    int reserved = 0, why;
    Py_BEGIN_ALLOW_THREADS
    why = walk((const unsigned char *)view.buf, view.len, budget, &spent, &reserved);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(iL)", why, why == WALK_OK ? spent : (long long)reserved);
}

static PyMethodDef core_methods[] = {
    {"bell_recv", core_bell_recv, METH_O, bell_recv_doc},
    {"fence", core_fence, METH_NOARGS, fence_doc},
    {"store", (PyCFunction)(void (*)(void))core_store, METH_FASTCALL, store_doc},
    {"write_message", (PyCFunction)(void (*)(void))core_write_message, METH_FASTCALL, write_message_doc},
    {"read_message", (PyCFunction)(void (*)(void))core_read_message, METH_FASTCALL, read_message_doc},
    {"poll", (PyCFunction)(void (*)(void))core_poll, METH_FASTCALL, poll_doc},
    {"relay_ready", core_relay_ready, METH_NOARGS, relay_ready_doc},
    {"relay_one", (PyCFunction)(void (*)(void))core_relay_one, METH_FASTCALL, relay_one_doc},
    {"wait_readable", (PyCFunction)(void (*)(void))core_wait_readable, METH_FASTCALL, wait_readable_doc},
    {"take_message", (PyCFunction)(void (*)(void))core_take_message, METH_FASTCALL, take_message_doc},
    {"wait_message", (PyCFunction)(void (*)(void))core_wait_message, METH_FASTCALL, wait_message_doc},
    {"walk", (PyCFunction)(void (*)(void))core_walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "zbus._core", "The ring's per-message steps in C (see zbus.ring).", -1, core_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    walk_init();
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    main_thread_ident = ident ? PyLong_AsUnsignedLong(ident) : 0;
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    if (PyErr_Occurred())
        return NULL;
    if (pthread_atfork(NULL, NULL, forked_child) != 0)
        return PyErr_NoMemory();
    if (PyType_Ready(&PartType) < 0)
        return NULL;
    return PyModule_Create(&core_module);
}
