/* The CUDA driver emulator's IPC entry points: device memory shared
 * between processes through its memfd (see README.md for the handle). */
#include "emu.h"

/* What cuIpcGetMemHandle writes in the 64-byte CUipcMemHandle: enough
 * for another process of the same user to open the memfd through
 * /proc/PID/fd/FD and check it is still that allocation. */
#define IPC_MAGIC 0x50494c44u /* "DLIP" */
struct ipc_wire {
    uint32_t magic, uid;
    int32_t pid, fd;
    uint64_t inode, size;
    int32_t device, reserved;
};
typedef struct {
    char reserved[64];
} CUipcMemHandle;
_Static_assert(sizeof(struct ipc_wire) <= sizeof(CUipcMemHandle), "the IPC handle is 64 bytes");

/* ---- entry points ------------------------------------------------------- */

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    ENTER(cuIpcGetMemHandle);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation *a = find_allocation(dptr);
    /* Like the driver: the base of a cuMemAlloc allocation of this process. */
    if (!handle || !a || a->dptr != dptr || a->exporter)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct ipc_wire wire = {IPC_MAGIC, (uint32_t)getuid(), (int32_t)getpid(), a->fd, (uint64_t)a->inode,
                            (uint64_t)a->size, a->device, 0};
    memset(handle, 0, sizeof *handle);
    memcpy(handle, &wire, sizeof wire);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned flags)
{
    ENTER(cuIpcOpenMemHandle_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct ipc_wire wire;
    memcpy(&wire, &handle, sizeof wire);
    if (!pdptr || flags > 1 || wire.magic != IPC_MAGIC)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (wire.pid == (int32_t)getpid()) /* the driver refuses a process its own memory */
        RETURN(CUDA_ERROR_INVALID_CONTEXT);
    /* No peer memory: the handle's device must be the current context's. */
    if (wire.device != current()->device)
        RETURN(CUDA_ERROR_INVALID_DEVICE);
    /* Opened again while open: the same address, counted (as the driver). */
    for (struct allocation *a = allocations; a; a = a->next)
        if (a->exporter == wire.pid && a->inode == (ino_t)wire.inode) {
            a->opens++;
            *pdptr = a->dptr;
            RETURN(CUDA_SUCCESS);
        }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", wire.pid, wire.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) /* another user's process, or the exporter is gone */
        RETURN(errno == EACCES || errno == EPERM ? CUDA_ERROR_NOT_PERMITTED : CUDA_ERROR_INVALID_HANDLE);
    /* The fd number may have been reused since: it must be that memfd. */
    struct stat st;
    size_t rounded = (wire.size + 511) & ~(uint64_t)511;
    if (fstat(fd, &st) || st.st_ino != (ino_t)wire.inode || (uint64_t)st.st_size != rounded) {
        close(fd);
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    }
    /* Backed as copies first write it, as in the exporter. */
    void *host = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (host == MAP_FAILED)
        RETURN(CUDA_ERROR_MAP_FAILED);
    struct allocation *a = add_allocation(wire.device, wire.size, host);
    a->inode = (ino_t)wire.inode;
    a->exporter = wire.pid;
    a->opens = 1;
    *pdptr = a->dptr;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    ENTER(cuIpcCloseMemHandle);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation **link = &allocations;
    while (*link && !((*link)->dptr == dptr && (*link)->exporter))
        link = &(*link)->next;
    struct allocation *a = *link;
    if (!a)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (--a->opens)
        RETURN(CUDA_SUCCESS);
    if (a->pending) {
        if (cfg.strict)
            die("strict: cuIpcCloseMemHandle of %#llx..%#llx with %u copies into it pending", a->dptr,
                a->dptr + a->size, a->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = a->next;
    munmap(a->host, (a->size + 511) & ~(size_t)511);
    struct closed *c = calloc(1, sizeof *c);
    c->dptr = a->dptr;
    c->size = a->size;
    c->next = closed_mappings;
    closed_mappings = c;
    free(a);
    RETURN(CUDA_SUCCESS);
}
