/*
 * The C library from C: bad arguments, missing and truncated files, an
 * unknown heap, ENOMEM, a FIFO whose reader leaves, and loads and saves
 * whose bytes are checked.
 * Built with the system C compiler against the installed header and
 * library, run by tests/c.rs:
 *
 *   capi_test SCRATCH_DIR
 *
 * Prints one line per check and "N passed, N failed" last; exits non-zero
 * when a check failed.
 */
#define _GNU_SOURCE
#include <dmaload.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int passed, failed;

static void check(int ok, const char *what)
{
	if (ok) {
		passed++;
		printf("ok - %s\n", what);
	} else {
		failed++;
		printf("FAIL - %s (last error: errno %d, \"%s\")\n", what, dmaload_last_errno(),
		       dmaload_last_error());
	}
}

/* A call that must fail with `errno_expected` and a message containing `needle`. */
static void check_error(int rc, int errno_expected, const char *needle, const char *what)
{
	int ok = rc == errno_expected && errno == errno_expected && dmaload_last_errno() == errno_expected &&
		 strstr(dmaload_last_error(), needle) != NULL;
	if (!ok)
		printf("  returned %d, wanted %d with a message containing \"%s\"\n", rc, errno_expected, needle);
	check(ok, what);
}

static uint8_t pattern(uint64_t offset)
{
	return (uint8_t)(offset % 251 + (offset >> 20));
}

static int matches(const uint8_t *bytes, size_t len, uint64_t offset)
{
	for (size_t i = 0; i < len; i++)
		if (bytes[i] != pattern(offset + i))
			return 0;
	return 1;
}

static void write_pattern(const char *path, size_t len)
{
	uint8_t *bytes = malloc(len);
	for (size_t i = 0; i < len; i++)
		bytes[i] = pattern(i);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(bytes, 1, len, f) != len || fclose(f) != 0) {
		perror(path);
		exit(2);
	}
	free(bytes);
}

/* What a call made while its thread exits saw: rc, errno, last error. */
static struct {
	int rc, last_errno;
	char message[512];
} exiting;

/* A pthread key's destructor: it runs after the thread's other storage
 * is freed, as an atexit handler does for the main thread. */
static void save_while_exiting(void *path)
{
	exiting.rc = dmaload_save(path, "abc", 3, NULL, NULL);
	exiting.last_errno = dmaload_last_errno();
	snprintf(exiting.message, sizeof exiting.message, "%s", dmaload_last_error());
}

static void *fail_once_then_exit(void *key)
{
	/* This thread's last error exists (and is freed on exit) before the destructor runs. */
	dmaload_save("", "abc", 3, NULL, NULL);
	pthread_setspecific(*(pthread_key_t *)key, "/no-such-dir/saved-at-exit");
	return NULL;
}

static int exists(const char *path)
{
	return access(path, F_OK) == 0;
}

/* A save into a FIFO whose reader leaves mid-way, in a child whose SIGPIPE
 * has its default action (terminate), as in any C program: the save must
 * fail with EPIPE, naming the FIFO and the offset, and the child live on. */
static void save_into_a_fifo_whose_reader_leaves(const char *fifo)
{
	if (mkfifo(fifo, 0600) != 0) {
		check(0, "mkfifo");
		return;
	}
	fflush(stdout);
	pid_t child = fork();
	if (child == 0) {
		signal(SIGPIPE, SIG_DFL);
		int reader = open(fifo, O_RDONLY | O_NONBLOCK);
		pid_t leaver = fork();
		if (leaver == 0) {
			/* The reader: gone once the first bytes arrive. */
			struct pollfd bytes = {.fd = reader, .events = POLLIN};
			poll(&bytes, 1, 10000);
			_exit(0);
		}
		close(reader);
		const size_t len = 16 << 20; /* far more than a pipe holds */
		uint8_t *data = calloc(len, 1);
		int rc = dmaload_save(fifo, data, len, NULL, NULL);
		int ok = rc == EPIPE && dmaload_last_errno() == EPIPE && strstr(dmaload_last_error(), fifo) != NULL &&
			 strstr(dmaload_last_error(), "offset") != NULL;
		if (!ok)
			printf("  the save returned %d: \"%s\"\n", rc, dmaload_last_error());
		waitpid(leaver, NULL, 0);
		fflush(stdout);
		_exit(ok ? 0 : 1);
	}
	int status = 0;
	int waited = child > 0 && waitpid(child, &status, 0) == child;
	if (waited && WIFSIGNALED(status))
		printf("  the saving process was killed by signal %d\n", WTERMSIG(status));
	check(waited && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "a save into a FIFO whose reader left is EPIPE, not death by SIGPIPE");
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]);
		return 2;
	}
	char file[4096], missing[4096], saved[4096], nodir[4096], sparse[4096], fifo[4096];
	snprintf(file, sizeof file, "%s/pattern", argv[1]);
	snprintf(missing, sizeof missing, "%s/no-such-file", argv[1]);
	snprintf(saved, sizeof saved, "%s/saved", argv[1]);
	snprintf(nodir, sizeof nodir, "%s/no-such-dir/saved", argv[1]);
	snprintf(sparse, sizeof sparse, "%s/sparse", argv[1]);
	snprintf(fifo, sizeof fifo, "%s/fifo", argv[1]);
	const size_t len = (3 << 20) + 4321;
	write_pattern(file, len);

	check(strlen(dmaload_version()) > 0, "dmaload_version is a version");
	dmaload_load_options options = dmaload_load_options_default();
	check(options.engine == DMALOAD_ENGINE_URING_FIXED && options.mode == DMALOAD_MODE_AUTO &&
		      options.to == NULL && options.chunk_size == 4 << 20 && options.queue_depth == 32 &&
		      options.staging_slots == 0 && options.staging_slot_size == 0,
	      "the default options are the CLI's");

	/* Bad arguments: an error, never a crash. */
	dmaload_buffer *buffer = NULL;
	check_error(dmaload_load(NULL, NULL, &buffer), EINVAL, "dmaload_load: path is NULL", "NULL path");
	check_error(dmaload_load("", NULL, &buffer), EINVAL, "path is empty", "zero-length path");
	check_error(dmaload_load(file, NULL, NULL), EINVAL, "out is NULL", "NULL out");
	check(buffer == NULL, "a failed load leaves *out alone");
	dmaload_load_options bad = options;
	bad.engine = 99;
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "engine 99", "an engine out of range");
	bad = options;
	bad.mode = 7;
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "mode 7", "a mode out of range");
	bad = options;
	bad.to = "vram";
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "unknown destination \"vram\"", "an unknown destination");
	bad = options;
	bad.chunk_size = 0;
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "chunk size 0", "a zero chunk size");
	/* The core's check of the staging ring, in the CLI's and Python's words. */
	bad = options;
	bad.staging_slots = 1;
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "staging slots 1 must be at least 2",
		    "a staging ring of one slot");
	bad = options;
	bad.staging_slot_size = (uint64_t)2 << 30;
	check_error(dmaload_load(file, &bad, &buffer), EINVAL,
		    "staging slot size 2147483648 must be between 1 byte and 1 GiB", "a staging slot over 1 GiB");
	bad = options;
	bad.to = "udmabuf";
	check_error(dmaload_load(file, &bad, &buffer), EINVAL, "load_dmabuf", "a dma-buf target for a host load");
	check(dmaload_buffer_data(NULL) == NULL && dmaload_buffer_len(NULL) == 0 && dmaload_buffer_memfd(NULL) == -1 &&
		      dmaload_buffer_report(NULL) == NULL && dmaload_xxh3_64(NULL, 5) == 0,
	      "NULL buffers read as empty");
	dmaload_buffer_free(NULL);
	dmaload_report_free(NULL);
	dmaload_save_report_free(NULL);

	/* Verified loads, against the sums coreutils' sha256sum writes. */
	{
		char command[8300], sums[4200];
		snprintf(sums, sizeof sums, "%s/SHA256SUMS", argv[1]);
		check(options.verify == 0, "verify is off by default");
		dmaload_load_options verified = options;
		verified.verify = 1;
		check_error(dmaload_load(file, &verified, &buffer), EINVAL, "SHA256SUMS", "verify without a sums file");
		snprintf(command, sizeof command, "cd '%s' && sha256sum pattern > SHA256SUMS", argv[1]);
		check(system(command) == 0, "sha256sum writes the sums file");
		check(dmaload_load(file, &verified, &buffer) == 0 && dmaload_buffer_len(buffer) == len,
		      "a good file verifies");
		dmaload_buffer_free(buffer);
		buffer = NULL;
		for (int round = 0; round < 2; round++) {
			/* Flipped, then flipped back for the tests below. */
			FILE *f = fopen(file, "r+b");
			fseek(f, 2 << 20, SEEK_SET);
			int byte = fgetc(f);
			fseek(f, 2 << 20, SEEK_SET);
			fputc(byte ^ 1, f);
			fclose(f);
			if (round == 0) {
				check_error(dmaload_load(file, &verified, &buffer), EBADMSG, "SHA-256 mismatch",
					    "one flipped byte fails verification");
				check(buffer == NULL, "a failed verification returns no buffer");
			}
		}
		unlink(sums);
	}

	/* A call failing while its thread exits: an error, not an abort. */
	{
		pthread_key_t key;
		pthread_t thread;
		check(pthread_key_create(&key, save_while_exiting) == 0 &&
			      pthread_create(&thread, NULL, fail_once_then_exit, &key) == 0 &&
			      pthread_join(thread, NULL) == 0,
		      "a thread that saves from a pthread key destructor");
		/* Whether the library's thread storage is freed before this key's
		 * destructor runs depends on the libc and the linking (a static
		 * build's order differs): the message is the failure's, or a note
		 * that it is gone. */
		check(exiting.rc == ENOENT && exiting.last_errno == ENOENT &&
			      (strstr(exiting.message, "exiting") != NULL || strstr(exiting.message, "no-such-dir") != NULL),
		      "a failure while the thread exits keeps its errno");
		pthread_key_delete(key);
	}

	save_into_a_fifo_whose_reader_leaves(fifo);

	/* Files that are not there, or shorter than asked. */
	check_error(dmaload_load(missing, NULL, &buffer), ENOENT, missing, "a missing file names its path");
	check_error(dmaload_load_range(file, 1 << 20, 4 << 20, NULL, &buffer), ENODATA, "extends past the end",
		    "a range past the end of a truncated file");
	check(strstr(dmaload_last_error(), file) != NULL && strstr(dmaload_last_error(), "offset") != NULL,
	      "the truncation names the path and the offset");
	check_error(dmaload_load_range(file, len + 1, 1, NULL, &buffer), EINVAL, "past the end",
		    "an offset past the end");

	/* Loads whose bytes are checked. */
	int rc = dmaload_load(file, &options, &buffer);
	check(rc == 0 && buffer != NULL, "dmaload_load loads");
	if (rc == 0) {
		const dmaload_report *report = dmaload_buffer_report(buffer);
		check(dmaload_buffer_len(buffer) == len && matches(dmaload_buffer_data(buffer), len, 0),
		      "the buffer holds the file");
		check(report->bytes == len && report->offset == 0 && strcmp(report->destination, "memfd") == 0 &&
			      strstr(report->json, "\"bytes\":") != NULL && report->total_seconds > 0,
		      "the report says what the load did");
		check(dmaload_buffer_memfd(buffer) >= 0, "a memfd buffer has its fd");
		/* Saved back whole, then the save's own errors. */
		dmaload_save_report *saved_report = NULL;
		rc = dmaload_save(saved, dmaload_buffer_data(buffer), len, NULL, &saved_report);
		check(rc == 0 && saved_report != NULL && saved_report->bytes == len, "dmaload_save saves");
		dmaload_save_report_free(saved_report);
		dmaload_buffer *again = NULL;
		check(dmaload_load(saved, NULL, &again) == 0 && dmaload_buffer_len(again) == len &&
			      matches(dmaload_buffer_data(again), len, 0),
		      "the saved file holds the bytes");
		dmaload_buffer_free(again);
		check_error(dmaload_save(saved, NULL, 10, NULL, NULL), EINVAL, "data is NULL", "a save of NULL data");
		check_error(dmaload_save(nodir, dmaload_buffer_data(buffer), 10, NULL, NULL), ENOENT, "/no-such-dir",
			    "a save into a missing directory names it");
		dmaload_buffer_free(buffer);
	}
	rc = dmaload_load_range(file, 5000, 70000, NULL, &buffer);
	check(rc == 0 && dmaload_buffer_len(buffer) == 70000 && matches(dmaload_buffer_data(buffer), 70000, 5000),
	      "dmaload_load_range loads an unaligned range");
	dmaload_buffer_free(buffer);
	dmaload_load_options anonymous = options;
	anonymous.to = "anonymous";
	rc = dmaload_load(file, &anonymous, &buffer);
	check(rc == 0 && matches(dmaload_buffer_data(buffer), len, 0) && dmaload_buffer_memfd(buffer) == -1 &&
		      strcmp(dmaload_buffer_report(buffer)->destination, "anonymous") == 0,
	      "anonymous memory holds the file and has no fd");
	dmaload_buffer_free(buffer);

	/* Empty buffers (an empty file, an empty range): their data is NULL, never a
	 * pointer that cannot be read, and (NULL, 0) goes on to the other calls. */
	{
		char empty[4096];
		snprintf(empty, sizeof empty, "%s/empty", argv[1]);
		write_pattern(empty, 0);
		dmaload_buffer *nothing[2] = {NULL, NULL};
		check(dmaload_load(empty, NULL, &nothing[0]) == 0 && dmaload_load_range(file, 5000, 0, NULL, &nothing[1]) == 0,
		      "an empty file and an empty range load");
		for (int i = 0; i < 2; i++) {
			const uint8_t *data = dmaload_buffer_data(nothing[i]);
			check(nothing[i] != NULL && dmaload_buffer_len(nothing[i]) == 0 && data == NULL,
			      "an empty buffer's data is NULL");
			check(dmaload_xxh3_64(data, 0) == 0x2d06800538d394c2ULL &&
				      dmaload_save(saved, data, dmaload_buffer_len(nothing[i]), NULL, NULL) == 0,
			      "an empty buffer hashes and saves as nothing");
			dmaload_buffer_free(nothing[i]);
		}
	}

	/* Memory the caller owns: page-aligned (in place) and off by one (staged). */
	{
		uint8_t *memory = aligned_alloc(4096, 3 * 4096 + 70000);
		dmaload_report *into = NULL;
		check(memory != NULL, "aligned_alloc");
		rc = dmaload_load_into(file, 4096, memory, 70000, NULL, &into);
		check(rc == 0 && matches(memory, 70000, 4096) && into != NULL && into->bytes == 70000 &&
			      strcmp(into->destination, "caller memory (in place)") == 0,
		      "dmaload_load_into fills page-aligned memory in place");
		dmaload_report_free(into);
		rc = dmaload_load_into(file, 5000, memory + 1, 70000, NULL, NULL);
		check(rc == 0 && matches(memory + 1, 70000, 5000), "dmaload_load_into fills unaligned memory");
		check_error(dmaload_load_into(file, 0, NULL, 10, NULL, NULL), EINVAL, "dst is NULL",
			    "dmaload_load_into refuses NULL memory");
		check(dmaload_load_into(file, 0, NULL, 0, NULL, NULL) == 0, "dmaload_load_into of nothing");
		check_error(dmaload_load_into(file, 0, memory, SIZE_MAX, NULL, NULL), EINVAL, "cannot be in memory",
			    "dmaload_load_into of more bytes than memory can hold");
		check(dmaload_xxh3_64(memory, SIZE_MAX) == 0, "dmaload_xxh3_64 of more bytes than memory can hold is 0");
		check_error(dmaload_load_into(file, len - 10, memory, 20, NULL, NULL), ENODATA, file,
			    "dmaload_load_into past the end names the file");
		check_error(dmaload_load_into(file, UINT64_MAX - 8, memory, 16, NULL, NULL), EINVAL, "past the end",
			    "dmaload_load_into of a range whose end overflows");
		free(memory);
	}

	/* Dma-bufs: the arguments everywhere, the loads where the kernel has them. */
	dmaload_dmabuf dmabuf;
	check_error(dmaload_load_dmabuf(file, "dma-heap:no-such-heap", NULL, &dmabuf), EINVAL,
		    "/dev/dma_heap/no-such-heap", "an unknown heap names its path");
	check_error(dmaload_load_dmabuf(file, "memfd", NULL, &dmabuf), EINVAL, "not a dma-buf",
		    "a host target for a dma-buf load");
	check_error(dmaload_load_dmabuf(file, "dmabuf", NULL, NULL), EINVAL, "out is NULL", "NULL dma-buf out");
	bad = options;
	bad.to = "vram";
	bad.chunk_size = 0;
	check_error(dmaload_load_dmabuf(file, "dma-heap:no-such-heap", &bad, &dmabuf), EINVAL, "chunk size 0",
		    "a dma-buf load ignores the options' to, not the rest");
	check_error(dmaload_load_dmabuf(missing, "dmabuf", NULL, &dmabuf), ENOENT, missing,
		    "a missing file for a dma-buf");
	check_error(dmaload_dmabuf_xxh3_64(NULL, NULL), EINVAL, "dmabuf is NULL", "hashing a NULL dma-buf");
	{
		/* A plain file's fd is no dma-buf, whatever the caller says. */
		dmaload_dmabuf plain = {.fd = open(file, O_RDONLY | O_CLOEXEC), .size = 16, .len = 16};
		uint64_t hash = 0;
		check_error(dmaload_dmabuf_xxh3_64(&plain, &hash), EINVAL, "not a dma-buf",
			    "hashing a regular file's fd as a dma-buf");
		close(plain.fd);
	}
	const char *targets[] = {"udmabuf", "dma-heap:system", "dmabuf"};
	const char *devices[] = {"/dev/udmabuf", "/dev/dma_heap/system", NULL};
	for (int t = 0; t < 3; t++) {
		int present = devices[t] ? exists(devices[t])
					 : exists("/dev/udmabuf") || exists("/dev/dma_heap/system");
		char what[128];
		rc = dmaload_load_dmabuf_range(file, 5000, 70000, targets[t], NULL, &dmabuf);
		if (!present) {
			snprintf(what, sizeof what, "%s where the kernel has none is EINVAL", targets[t]);
			check(rc == EINVAL, what);
			printf("SKIP %s: no such device here\n", targets[t]);
			continue;
		}
		snprintf(what, sizeof what, "dmaload_load_dmabuf_range into %s", targets[t]);
		check(rc == 0, what);
		if (rc != 0)
			continue;
		uint64_t hash = 0;
		uint8_t *expected = malloc(70000);
		for (size_t i = 0; i < 70000; i++)
			expected[i] = pattern(5000 + i);
		snprintf(what, sizeof what, "the %s dma-buf holds the range (%s)", targets[t], dmabuf.report->destination);
		check(dmaload_dmabuf_xxh3_64(&dmabuf, &hash) == 0 && hash == dmaload_xxh3_64(expected, 70000) &&
			      dmabuf.len == 70000 && dmabuf.data_offset + dmabuf.len <= dmabuf.size,
		      what);
		free(expected);
		dmaload_report_free(dmabuf.report);
		close(dmabuf.fd);
	}

	/* The options size a dma-heap load's staging ring, which is else sized from the range. */
	if (exists("/dev/dma_heap/system")) {
		dmaload_load_options ring = options;
		ring.staging_slots = 3;
		ring.staging_slot_size = 64 << 10;
		rc = dmaload_load_dmabuf_range(file, 5000, 70000, "dma-heap:system", &ring, &dmabuf);
		check(rc == 0 && strstr(dmabuf.report->destination, "staging ring (3 x 65536 bytes)") != NULL,
		      "dma-heap:system through the options' staging ring");
		if (rc == 0) {
			dmaload_report_free(dmabuf.report);
			close(dmabuf.fd);
		}
	} else {
		printf("SKIP the options' staging ring for dma-heap:system: no such device here\n");
	}

	/* ENOMEM: a file larger than the address space this process may still map. */
	int fd = open(sparse, O_CREAT | O_TRUNC | O_WRONLY, 0644);
	check(fd >= 0 && ftruncate(fd, (off_t)4 << 30) == 0 && close(fd) == 0, "a 4 GiB sparse file");
	struct rlimit limit = {.rlim_cur = (rlim_t)1 << 30, .rlim_max = (rlim_t)1 << 30};
	FILE *status = fopen("/proc/self/status", "r");
	char line[256];
	while (status && fgets(line, sizeof line, status))
		if (strncmp(line, "VmSize:", 7) == 0)
			limit.rlim_cur = limit.rlim_max = (strtoull(line + 7, NULL, 10) << 10) + (512 << 20);
	if (status)
		fclose(status);
	check(setrlimit(RLIMIT_AS, &limit) == 0, "RLIMIT_AS: what is mapped + 512 MiB");
	rc = dmaload_load(sparse, NULL, &buffer);
	check_error(rc, ENOMEM, sparse, "a load past RLIMIT_AS is ENOMEM, naming the path");
	if (rc == 0)
		dmaload_buffer_free(buffer);

	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
