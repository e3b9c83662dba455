/* The CUDA driver emulator's copy engine (a worker thread per stream
 * moving queued copies over the modelled link, the race detector's
 * hashes) and the entry points that queue and wait on it: the async copy,
 * streams and events (see emu.h). */
#include "emu.h"

#define PIECE (1u << 20) /* a copy advances over the link in pieces this big */

struct op {
    struct op *next;
    unsigned char *dst;
    const unsigned char *src;
    size_t len;
    uint64_t hash;
    struct registration *reg; /* pinned source, or NULL for driver staging */
    unsigned char *staged; /* the driver's own copy of a pageable source */
    struct allocation *alloc;
    enum fault_kind fault; /* FAULT_RETURN: none */
    CUresult fault_code; /* FAULT_DELAY: microseconds */
};

#define STREAM_MAGIC 0x5354524d
#define EVENT_MAGIC 0x45564e54
#define DEAD_MAGIC 0xdead

struct event {
    unsigned magic;
    struct context *ctx;
    struct stream *stream; /* the last record, or NULL */
    uint64_t target; /* complete once stream->done reaches it */
};

static uint64_t link_free_at[MAX_DEVICES]; /* ns: when the link is next idle */
static uint64_t bytes_copied;
static unsigned long copies; /* async copies queued so far (copy#N) */

/* A 64-bit hash of the bytes, eight at a time (fast enough to run twice
 * per copy in strict mode). */
static uint64_t hash_bytes(const unsigned char *p, size_t len)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; i < len; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* ---- the copy engine ---------------------------------------------------- */

/* Moves one op's bytes over the modelled link, in pieces, without the lock. */
static void transfer(struct context *ctx, struct op *op)
{
    uint64_t latency = cfg.copy_latency_ns;
    if (op->fault == FAULT_DELAY)
        latency += (uint64_t)op->fault_code * 1000;
    if (latency)
        sleep_until(now_ns() + latency);
    for (size_t off = 0; off < op->len; off += PIECE) {
        /* A lost device's copy engines stop mid-copy. */
        if (__atomic_load_n(&lost, __ATOMIC_RELAXED))
            return;
        size_t piece = op->len - off < PIECE ? op->len - off : PIECE;
        uint64_t end = 0;
        if (cfg.link_bytes_per_ns > 0) {
            /* The piece's turn on the link; the host's memcpy runs inside
             * it, so only the modelled time counts. */
            pthread_mutex_lock(&lock);
            uint64_t begin = now_ns();
            if (link_free_at[ctx->device] > begin)
                begin = link_free_at[ctx->device];
            end = begin + (uint64_t)((double)piece / cfg.link_bytes_per_ns);
            link_free_at[ctx->device] = end;
            pthread_mutex_unlock(&lock);
        }
        memcpy(op->dst + off, op->src + off, piece);
        if (end)
            sleep_until(end);
    }
}

static void *stream_worker(void *arg)
{
    struct stream *s = arg;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&changed, &lock);
        if (!s->head)
            break;
        struct op *op = s->head;
        while ((op->fault == FAULT_HOLD && !s->waited) || op->fault == FAULT_HANG)
            pthread_cond_wait(&changed, &lock);
        int skip = s->ctx->sticky || lost;
        if (op->fault == FAULT_STICKY && !skip) {
            s->ctx->sticky = op->fault_code;
            skip = 1;
        }
        if (!skip) {
            transfers_running++;
            pthread_mutex_unlock(&lock);
            transfer(s->ctx, op);
            pthread_mutex_lock(&lock);
            transfers_running--;
            if (cfg.strict && hash_bytes(op->src, op->len) != op->hash)
                die("strict: the %zu-byte copy source at %p..%p (a pinned slot) was rewritten while its copy "
                    "to %#llx was pending: its event had not completed",
                    op->len, (void *)op->src, (void *)(op->src + op->len),
                    op->alloc->dptr + (CUdeviceptr)(op->dst - op->alloc->host));
            bytes_copied += op->len;
            if (cfg.lost_after && bytes_copied >= cfg.lost_after && !lost)
                __atomic_store_n(&lost, cfg.lost_code, __ATOMIC_RELAXED);
        }
        if (op->reg)
            op->reg->pending--;
        op->alloc->pending--;
        free(op->staged);
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        free(op);
        s->done++;
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

/* Waits (lock held) until `s` has done its first `target` ops. */
void wait_stream(struct stream *s, uint64_t target)
{
    s->waited = 1;
    pthread_cond_broadcast(&changed);
    while (s->done < target)
        pthread_cond_wait(&changed, &lock);
}

/* ---- entry points ------------------------------------------------------- */


static int valid_stream(CUstream s)
{
    for (struct stream *live = streams; live; live = live->next_live)
        if (live == s)
            return s->magic == STREAM_MAGIC;
    return 0;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s)
{
    ENTER(cuMemcpyHtoDAsync_v2);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!s || !valid_stream(s)) /* dmaload never copies on the legacy stream */
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (s->ctx->sticky)
        RETURN(s->ctx->sticky);
    struct allocation *alloc;
    unsigned char *bytes = device_bytes("cuMemcpyHtoDAsync", dst, len, &alloc);
    if (!bytes || !src || alloc->device != s->ctx->device)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct op *op = calloc(1, sizeof *op);
    op->dst = bytes;
    op->len = len;
    op->alloc = alloc;
    op->reg = find_registration(src, len);
    if (!op->reg && cfg.strict)
        die("strict: cuMemcpyHtoDAsync of %zu bytes to %#llx from pageable host memory %p..%p (no "
            "cuMemHostRegister range holds it): the driver would stage it and copy at a fraction of the link",
            len, dst, src, (const void *)((const unsigned char *)src + len));
    log_line("copy %p %zu\n", src, len);
    if (op->reg) {
        op->src = src;
        op->reg->pending++;
    } else {
        /* Pageable: the driver stages the bytes before returning. */
        op->staged = malloc(len ? len : 1);
        memcpy(op->staged, src, len);
        op->src = op->staged;
    }
    op->hash = cfg.strict ? hash_bytes(op->src, len) : 0;
    op->fault = FAULT_RETURN;
    unsigned long n = ++copies;
    for (int i = 0; i < cfg.nfaults; i++)
        if (cfg.faults[i].kind != FAULT_RETURN && cfg.faults[i].nth == n) {
            op->fault = cfg.faults[i].kind;
            op->fault_code = cfg.faults[i].code;
        }
    alloc->pending++;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->queued++;
    pthread_cond_broadcast(&changed);
    if (!op->reg) {
        /* Pageable: returns once the stream has taken the staged bytes. */
        uint64_t target = s->queued;
        while (s->done < target)
            pthread_cond_wait(&changed, &lock);
    }
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamCreate(CUstream *out, unsigned flags)
{
    ENTER(cuStreamCreate);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!out || flags > 1)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof *s);
    s->magic = STREAM_MAGIC;
    s->ctx = current();
    if (pthread_create(&s->worker, NULL, stream_worker, s)) {
        free(s);
        RETURN(CUDA_ERROR_OUT_OF_MEMORY);
    }
    s->next_live = streams;
    streams = s;
    *out = s;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamSynchronize(CUstream s)
{
    ENTER(cuStreamSynchronize);
    if (!valid_stream(s))
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    wait_stream(s, s->queued);
    RETURN(s->ctx->sticky);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
    ENTER(cuStreamDestroy_v2);
    if (!valid_stream(s))
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    /* Like the driver, returns at once; queued work still completes (a
     * hung copy keeps its worker). The record stays for events on it. */
    s->destroyed = 1;
    s->magic = DEAD_MAGIC;
    pthread_cond_broadcast(&changed);
    pthread_detach(s->worker);
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventCreate(CUevent *out, unsigned flags)
{
    ENTER(cuEventCreate);
    CUresult code = check_current();
    if (code)
        RETURN(code);
    if (!out || flags > 0xf)
        RETURN(CUDA_ERROR_INVALID_VALUE);
    struct event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->ctx = current();
    *out = e;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream s)
{
    ENTER(cuEventRecord);
    if (!e || e->magic != EVENT_MAGIC || !s || !valid_stream(s) || s->ctx != e->ctx)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (s->ctx->sticky)
        RETURN(s->ctx->sticky);
    e->stream = s;
    e->target = s->queued;
    RETURN(CUDA_SUCCESS);
}

EXPORT CUresult cuEventQuery(CUevent e)
{
    ENTER(cuEventQuery);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->ctx->sticky)
        RETURN(e->ctx->sticky);
    if (!e->stream || e->stream->done >= e->target)
        RETURN(CUDA_SUCCESS);
    /* Asking is waiting (a poller with a deadline): a held copy runs. */
    e->stream->waited = 1;
    pthread_cond_broadcast(&changed);
    RETURN(CUDA_ERROR_NOT_READY);
}

EXPORT CUresult cuEventSynchronize(CUevent e)
{
    ENTER(cuEventSynchronize);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    if (e->stream)
        wait_stream(e->stream, e->target);
    RETURN(e->ctx->sticky);
}

EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    ENTER(cuEventDestroy_v2);
    if (!e || e->magic != EVENT_MAGIC)
        RETURN(CUDA_ERROR_INVALID_HANDLE);
    e->magic = DEAD_MAGIC;
    free(e);
    RETURN(CUDA_SUCCESS);
}

