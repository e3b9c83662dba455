//! The CUDA destination end to end: a file read through a pinned staging
//! ring into device memory, compared byte for byte after copying it back.
//! Runs on the NVIDIA driver where one loads, else on the emulator in
//! tests/cuda-emu in strict mode (see `common::cuda_driver`); prints
//! "SKIP <test>: <reason>" only where neither can be used.

mod common;

use common::{pattern_byte, scratch_dir, skip, write_pattern_file};
use dmaload::cuda::{Context, DeviceBuffer};
use dmaload::sink::CudaSink;
use dmaload::{Engine, LoadOptions, StagingRing};

fn context(test: &str) -> Option<Context> {
    if let Err(reason) = common::cuda_driver() {
        skip(test, &reason);
        return None;
    }
    match Context::primary(0) {
        Ok(ctx) => Some(ctx),
        Err(err) => {
            skip(test, &format!("no CUDA device: {err}"));
            None
        }
    }
}

#[test]
fn files_reach_device_memory_bit_exact_through_a_small_ring() {
    let Some(ctx) = context("files_reach_device_memory_bit_exact_through_a_small_ring") else { return };
    let dir = scratch_dir();
    for (size, offset) in [(1u64, 0u64), (4097, 0), ((37 << 20) + 555, 0), ((37 << 20) + 555, 777)] {
        let path = dir.path().join(format!("f{size}-{offset}"));
        write_pattern_file(&path, size);
        let len = size - offset;
        for engine in [Engine::UringFixed, Engine::PreadPool] {
            // Two 1 MiB slots: each slot is reused many times.
            let mut ring = StagingRing::pinned(&ctx, 2, 1 << 20, 1 << 20).unwrap();
            let mut gpu = DeviceBuffer::new(&ctx, len as usize).unwrap();
            gpu.fill(0xA5).unwrap();
            let options = LoadOptions { engine, chunk_size: 1 << 20, ..LoadOptions::default() };
            {
                let mut sink = CudaSink::new(&ctx, vec![(offset, gpu.range())]).unwrap();
                dmaload::LoadRequest::path(&path)
                    .range(offset, None)
                    .options(&options)
                    .to_sink(&mut ring, &mut sink)
                    .unwrap_or_else(|e| panic!("{engine:?} {size}: {e}"));
            }
            let mut back = vec![0u8; len as usize];
            gpu.copy_to_host(0, &mut back).unwrap();
            if let Some(i) = back.iter().enumerate().position(|(i, &b)| b != pattern_byte(offset + i as u64))
            {
                panic!("{engine:?} size {size}: device byte {i} differs");
            }
        }
    }
}

#[test]
fn a_sink_scatters_one_slot_to_several_targets() {
    let Some(ctx) = context("a_sink_scatters_one_slot_to_several_targets") else { return };
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 3 << 20);
    let mut ring = StagingRing::pinned(&ctx, 2, 4 << 20, 4 << 20).unwrap();
    // Three targets inside one slot, one spanning into the next, a gap skipped.
    let spans = [(10u64, 100usize), (5000, 70_000), ((1 << 20) - 3, (2 << 20) + 3)];
    let mut buffers: Vec<DeviceBuffer> =
        spans.iter().map(|&(_, len)| DeviceBuffer::new(&ctx, len).unwrap()).collect();
    {
        let targets =
            spans.iter().zip(buffers.iter_mut()).map(|(&(offset, _), b)| (offset, b.range())).collect();
        let mut sink = CudaSink::new(&ctx, targets).unwrap();
        dmaload::LoadRequest::path(&path).to_sink(&mut ring, &mut sink).unwrap();
    }
    for (&(offset, len), buffer) in spans.iter().zip(&buffers) {
        let mut back = vec![0u8; len];
        buffer.copy_to_host(0, &mut back).unwrap();
        common::assert_pattern(&back, offset);
    }
}
