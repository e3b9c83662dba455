/* The CUDA driver emulator's device memory and pinned host memory:
 * allocations, host registrations, pointer attributes, and the
 * synchronous memset and copy back to the host (see emu.h). */
#include "emu.h"

/* CUpointer_attribute and CUmemorytype values. */
enum { ATTR_MEMORY_TYPE = 2, ATTR_DEVICE_ORDINAL = 9, ATTR_RANGE_START = 11, ATTR_RANGE_SIZE = 12 };
enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };
/* CU_MEMHOSTREGISTER_READ_ONLY */
enum { MEMHOSTREGISTER_READ_ONLY = 0x08 };

static struct registration *registrations;
static size_t allocated[MAX_DEVICES]; /* bytes allocated on each device */

/* The allocation holding device address `p`, or NULL. Lock held. */
struct allocation *find_allocation(CUdeviceptr p)
{
    for (struct allocation *a = allocations; a; a = a->next)
        if (p >= a->dptr && p - a->dptr < a->size)
            return a;
    return NULL;
}

/* The registration holding all `len` bytes at `p`, or NULL. Lock held. */
struct registration *find_registration(const void *p, size_t len)
{
    const unsigned char *b = p;
    for (struct registration *r = registrations; r; r = r->next)
        if (b >= r->start && (size_t)(b - r->start) < r->len && len <= r->len - (size_t)(b - r->start))
            return r;
    return NULL;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    ENTER(cuMemGetInfo_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!free_bytes || !total)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    *total = cfg.memory;
    *free_bytes = cfg.memory - allocated[current()->device];
    RETURN(CUDA_SUCCESS);
}

/* Records `host` as `size` bytes of device memory at the next device
 * address of `device`. Lock held. */
struct allocation *add_allocation(int device, size_t size, unsigned char *host)
{
    struct allocation *a = calloc(1, sizeof *a);
    a->dptr = next_dptr[device];
    a->size = size;
    a->device = device;
    a->host = host;
    a->fd = -1;
    a->next = allocations;
    allocations = a;
    /* Addresses are never reused, so a stale pointer stays unknown. */
    next_dptr[device] += (size + 511 + 0xfffff) & ~(CUdeviceptr)0xfffff;
    return a;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    ENTER(cuMemAlloc_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!dptr || !size)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    int device = current()->device;
    size_t rounded = (size + 511) & ~(size_t)511; /* the driver's 512-byte granule */
    if (rounded > cfg.memory - allocated[device])
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    /* Shared memory, so cuIpcOpenMemHandle in another process maps the
     * same bytes. Backed as copies first write it, not here: a device
     * allocates in a few milliseconds whatever the size, while populating
     * host memory costs about a second a GiB on a small VM (which a load
     * would be charged as its set-up). The page faults of the copies run
     * inside the modelled link's time. */
    char name[32];
    snprintf(name, sizeof name, "cuda-emu cuda:%d", device);
    int fd = memfd_create(name, MFD_CLOEXEC);
    struct stat st;
    if (fd < 0 || ftruncate(fd, (off_t)rounded) || fstat(fd, &st)) {
        if (fd >= 0)
            close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    void *host = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) {
        close(fd);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct allocation *a = add_allocation(device, size, host);
    a->fd = fd;
    a->inode = st.st_ino;
    allocated[device] += rounded;
    *dptr = a->dptr;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct allocation **link = &allocations;
    while (*link && (*link)->dptr != dptr)
        link = &(*link)->next;
    struct allocation *a = *link;
    if (!a || a->exporter) /* an opened IPC handle is closed, not freed */
        RETURN(CUDA_ERROR_INVALID_VALUE);
    if (a->pending) {
        if (cfg.strict)
            die("strict: cuMemFree of device memory %#llx..%#llx with %u copies into it pending", a->dptr,
                a->dptr + a->size, a->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = a->next;
    allocated[a->device] -= (a->size + 511) & ~(size_t)511;
    munmap(a->host, (a->size + 511) & ~(size_t)511);
    close(a->fd); /* an importer's mapping keeps the memory until it closes */
    free(a);
    RETURN(CUDA_SUCCESS);
}

/* The host bytes behind device span dptr..dptr+len, or NULL. `op` names
 * the call for strict mode, which aborts on an IPC mapping already closed. */
unsigned char *device_bytes(const char *op, CUdeviceptr dptr, size_t len, struct allocation **owner)
{
    struct allocation *a = find_allocation(dptr);
    if (!a && cfg.strict)
        for (struct closed *c = closed_mappings; c; c = c->next)
            if (dptr >= c->dptr && dptr - c->dptr < c->size)
                die("strict: %s at %#llx, in the IPC mapping %#llx..%#llx that cuIpcCloseMemHandle closed", op,
                    dptr, c->dptr, c->dptr + c->size);
    if (!a || len > a->size - (dptr - a->dptr))
        return NULL;
    if (owner)
        *owner = a;
    return a->host + (dptr - a->dptr);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dptr, unsigned char value, size_t len)
{
    ENTER(cuMemsetD8_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    unsigned char *bytes = device_bytes("cuMemsetD8", dptr, len, NULL);
    if (!bytes)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    memset(bytes, value, len);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len)
{
    ENTER(cuMemcpyDtoH_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    unsigned char *bytes = device_bytes("cuMemcpyDtoH", src, len, NULL);
    if (!bytes || !dst)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    memcpy(dst, bytes, len);
    RETURN(CUDA_SUCCESS);
}
/* Whether a registration holds any of `len` bytes at `start`. Lock held. */
static int overlaps_registration(const unsigned char *start, size_t len)
{
    for (struct registration *r = registrations; r; r = r->next)
        if (start < r->start + r->len && r->start < start + len)
            return 1;
    return 0;
}

EXPORT CUresult cuMemHostRegister_v2(void *ptr, size_t len, unsigned flags)
{
    ENTER(cuMemHostRegister_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    long page = sysconf(_SC_PAGESIZE);
    if (!ptr || !len)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    unsigned char *start = ptr;
    if (overlaps_registration(start, len))
        RETURN(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    /* Pinning faults every page in, at a cost per page, as the driver's
     * pin_user_pages does: writable unless the registration is read-only,
     * so memory registered fresh is allocated here, not at its first write
     * (a read would only map the shared zero page). Without the lock, as
     * pinning one range does not stop the copies of another. */
    pthread_mutex_unlock(&lock);
    uintptr_t first = (uintptr_t)start & ~(uintptr_t)(page - 1);
    size_t span = (size_t)((uintptr_t)start + len - first);
    size_t pages = (span + (size_t)page - 1) / (size_t)page;
    int advice = flags & MEMHOSTREGISTER_READ_ONLY ? MADV_POPULATE_READ : MADV_POPULATE_WRITE;
    if (madvise((void *)first, pages * (size_t)page, advice)) {
        if (errno != EINVAL) { /* not mapped (or not writable), or no memory left */
            CUresult refused = errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
            pthread_mutex_lock(&lock);
            RETURN(refused);
        }
        /* A kernel before 5.14: touching is the closest there is. */
        for (size_t i = 0; i < pages; i++)
            (void)*(volatile unsigned char *)(first + i * (size_t)page);
    }
    if (cfg.pin_ns_per_page)
        sleep_until(now_ns() + pages * cfg.pin_ns_per_page);
    pthread_mutex_lock(&lock);
    if (overlaps_registration(start, len)) /* registered meanwhile by another thread */
        RETURN(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    struct registration *r = calloc(1, sizeof *r);
    r->start = start;
    r->len = len;
    r->next = registrations;
    registrations = r;
    log_line("register %p %zu\n", ptr, len);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostUnregister(void *ptr)
{
    ENTER(cuMemHostUnregister);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    struct registration **link = &registrations;
    while (*link && (*link)->start != ptr)
        link = &(*link)->next;
    struct registration *r = *link;
    if (!r)
        RETURN(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    if (r->pending) {
        if (cfg.strict)
            die("strict: cuMemHostUnregister of the pinned slot %p..%p with %u copies from it pending", r->start,
                r->start + r->len, r->pending);
        for (struct stream *s = streams; s; s = s->next_live)
            wait_stream(s, s->queued);
    }
    *link = r->next;
    log_line("unregister %p %zu\n", r->start, r->len);
    free(r);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuPointerGetAttribute(void *data, unsigned attribute, CUdeviceptr ptr)
{
    ENTER(cuPointerGetAttribute);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!data)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct allocation *a = find_allocation(ptr);
    if (a) {
        switch (attribute) {
        case ATTR_MEMORY_TYPE: *(unsigned *)data = MEMORYTYPE_DEVICE; RETURN(CUDA_SUCCESS);
        case ATTR_DEVICE_ORDINAL: *(int *)data = a->device; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_START: *(CUdeviceptr *)data = a->dptr; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_SIZE: *(size_t *)data = a->size; RETURN(CUDA_SUCCESS);
        default: RETURN(CUDA_ERROR_INVALID_VALUE);
        }
    }
    struct registration *r = find_registration((const void *)(uintptr_t)ptr, 1);
    if (r) {
        switch (attribute) {
        case ATTR_MEMORY_TYPE: *(unsigned *)data = MEMORYTYPE_HOST; RETURN(CUDA_SUCCESS);
        case ATTR_DEVICE_ORDINAL: *(int *)data = 0; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_START: *(CUdeviceptr *)data = (CUdeviceptr)(uintptr_t)r->start; RETURN(CUDA_SUCCESS);
        case ATTR_RANGE_SIZE: *(size_t *)data = r->len; RETURN(CUDA_SUCCESS);
        default: RETURN(CUDA_ERROR_INVALID_VALUE);
        }
    }
    RETURN(CUDA_ERROR_INVALID_VALUE);
}

