/*
 * load FILE [TARGET]: loads FILE with dmaload's C library and prints what
 * the load did, then the xxh3-64 of the loaded bytes as 16 hex digits on
 * the last line (as `dmaload load --hash` computes it).
 *
 * Without TARGET the bytes go to a host buffer (a memfd); with TARGET
 * (udmabuf, dma-heap:NAME or dmabuf) into a new dma-buf, whose fd this
 * program owns and closes, hashed back through a fresh mapping of it.
 *
 *   cc load.c $(pkg-config --cflags --libs dmaload) -o load
 */
#include <dmaload.h>
#include <inttypes.h>
#include <stdio.h>
#include <unistd.h>

static int fail(const char *what)
{
	fprintf(stderr, "load: %s: %s (errno %d)\n", what, dmaload_last_error(), dmaload_last_errno());
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 2 && argc != 3) {
		fprintf(stderr, "usage: %s FILE [udmabuf|dma-heap:NAME|dmabuf]\n", argv[0]);
		return 2;
	}
	dmaload_load_options options = dmaload_load_options_default();
	uint64_t hash = 0;
	if (argc == 2) {
		dmaload_buffer *buffer = NULL;
		if (dmaload_load(argv[1], &options, &buffer) != 0)
			return fail("dmaload_load");
		const dmaload_report *report = dmaload_buffer_report(buffer);
		printf("%" PRIu64 " bytes into %s via %s in %.3f s (%.2f GiB/s)\n", report->bytes,
		       report->destination, report->engine, report->total_seconds, report->gib_per_second);
		hash = dmaload_xxh3_64(dmaload_buffer_data(buffer), dmaload_buffer_len(buffer));
		dmaload_buffer_free(buffer);
	} else {
		dmaload_dmabuf dmabuf;
		if (dmaload_load_dmabuf(argv[1], argv[2], &options, &dmabuf) != 0)
			return fail("dmaload_load_dmabuf");
		printf("%" PRIu64 " bytes into dma-buf fd %d (%" PRIu64 " bytes, data at %" PRIu64
		       ") via %s in %.3f s (%.2f GiB/s): %s\n",
		       dmabuf.len, dmabuf.fd, dmabuf.size, dmabuf.data_offset, dmabuf.report->engine,
		       dmabuf.report->total_seconds, dmabuf.report->gib_per_second, dmabuf.report->destination);
		int hashed = dmaload_dmabuf_xxh3_64(&dmabuf, &hash);
		dmaload_report_free(dmabuf.report);
		close(dmabuf.fd);
		if (hashed != 0)
			return fail("dmaload_dmabuf_xxh3_64");
	}
	printf("%016" PRIx64 "\n", hash);
	return 0;
}
