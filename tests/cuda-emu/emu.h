/* The CUDA driver emulator's internal header: the types, state and helpers
 * its files share (emu.c: settings, faults, state, devices and contexts;
 * memory.c: allocations, registrations, synchronous copies; copy.c: the
 * copy engine, streams and events; ipc.c: IPC handles). Nothing here is
 * exported: only the entry points, marked EXPORT where they are defined. */
#ifndef CUDA_EMU_H
#define CUDA_EMU_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Marks an entry point: the only symbols the library exports. */
#define EXPORT __attribute__((visibility("default")))

/* Internal declarations are hidden like their definitions
 * (-fvisibility=hidden), so the files reach each other's state and
 * helpers directly, never through the dynamic symbol table. */
#pragma GCC visibility push(hidden)

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct context *CUcontext;
typedef struct stream *CUstream;
typedef struct event *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_MAP_FAILED = 205,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
    CUDA_ERROR_UNKNOWN = 999,
};

/* ---- settings (read once, at cuInit) ------------------------------------ */

#define MAX_DEVICES 8
#define MAX_FAULTS 32

enum fault_kind { FAULT_RETURN, FAULT_STICKY, FAULT_HANG, FAULT_HOLD, FAULT_DELAY };

struct fault {
    enum fault_kind kind;
    char symbol[48]; /* FAULT_RETURN: the function; else "copy" */
    unsigned long nth;
    CUresult code; /* FAULT_DELAY: microseconds */
};

struct settings {
    int devices;
    size_t memory; /* bytes per device */
    double link_bytes_per_ns; /* 0: unlimited */
    uint64_t copy_latency_ns, pin_ns_per_page;
    int strict;
    struct fault faults[MAX_FAULTS];
    int nfaults;
    uint64_t lost_after; /* bytes; 0: never */
    CUresult lost_code;
    FILE *log; /* DMALOAD_EMU_LOG: pinning and copies, one line each */
};
extern struct settings cfg;

/* Appends a line to DMALOAD_EMU_LOG, where set. Lock held. */
void log_line(const char *fmt, ...);

/* ---- state -------------------------------------------------------------- */

struct context {
    int device, retained;
    CUresult sticky; /* a device-side error: every later call returns it */
};

struct stream {
    unsigned magic;
    struct context *ctx;
    struct op *head, *tail; /* its queued copies (copy.c) */
    uint64_t queued, done; /* ops queued and completed so far */
    int waited, destroyed;
    pthread_t worker;
    struct stream *next_live;
};

/* Device memory: a memfd of its own, mapped shared, so another process
 * can map the same bytes (cuIpcOpenMemHandle). */
struct allocation {
    struct allocation *next;
    CUdeviceptr dptr;
    size_t size;
    int device;
    unsigned char *host;
    unsigned pending;
    int fd; /* the memfd (-1 in an importer, which maps it and closes it) */
    ino_t inode; /* the memfd's, named by its IPC handle */
    pid_t exporter; /* an opened IPC handle: the process that allocated it; 0 for our own memory */
    unsigned opens; /* an opened IPC handle: cuIpcOpenMemHandle calls not yet closed */
};

/* Device addresses of IPC mappings already closed: strict mode names a
 * copy into one (addresses are never reused, so they stay unknown). */
struct closed {
    struct closed *next;
    CUdeviceptr dptr;
    size_t size;
};

struct registration {
    struct registration *next;
    unsigned char *start;
    size_t len;
    unsigned pending;
};

/* Shared state, defined in emu.c; all of it under `lock`. */
extern pthread_mutex_t lock;
extern pthread_cond_t changed;
extern int initialised; /* 0: cuInit not called or failed */
extern CUresult init_result;
extern struct allocation *allocations;
extern struct closed *closed_mappings;
extern struct stream *streams;
extern CUdeviceptr next_dptr[MAX_DEVICES];
extern CUresult lost; /* the device fell off the bus: every call returns it */
/* Copies moving bytes now, outside the lock: a call that reports the lost
 * device waits for them, as a driver reports it once the device's copy
 * engines are stopped (else a caller told of the loss would unmap a slot
 * a copy is still reading). */
extern unsigned transfers_running;

/* ---- helpers ------------------------------------------------------------ */

/* emu.c */
void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
uint64_t now_ns(void);
void sleep_until(uint64_t deadline);
CUresult injected(const char *symbol, unsigned long *calls);
struct context *current(void);
CUresult check_current(void);

/* memory.c */
struct allocation *find_allocation(CUdeviceptr p);
struct registration *find_registration(const void *p, size_t len);
struct allocation *add_allocation(int device, size_t size, unsigned char *host);
unsigned char *device_bytes(const char *op, CUdeviceptr dptr, size_t len, struct allocation **owner);

/* copy.c */
void wait_stream(struct stream *s, uint64_t target);

/* Every entry point but the version and error-text lookups starts here:
 * counts the call, applies injected faults, a lost device, and cuInit.
 * The count is a static of the entry point's own (one per ENTER site,
 * whichever file it is in), so `SYMBOL#N` is the Nth call of SYMBOL. */
#define ENTER(name)                                                                                                    \
    pthread_mutex_lock(&lock);                                                                                         \
    do {                                                                                                               \
        static unsigned long calls_;                                                                                   \
        CUresult early_ = injected(#name, &calls_);                                                                    \
        if (!early_ && lost) {                                                                                         \
            while (transfers_running)                                                                                  \
                pthread_cond_wait(&changed, &lock);                                                                    \
            early_ = lost;                                                                                             \
        }                                                                                                              \
        if (!early_ && !initialised)                                                                                   \
            early_ = init_result;                                                                                      \
        if (early_) {                                                                                                  \
            pthread_mutex_unlock(&lock);                                                                               \
            return early_;                                                                                             \
        }                                                                                                              \
    } while (0)

#define RETURN(code)                                                                                                   \
    do {                                                                                                               \
        CUresult result_ = (code);                                                                                     \
        pthread_mutex_unlock(&lock);                                                                                   \
        return result_;                                                                                                \
    } while (0)

#pragma GCC visibility pop

#endif

