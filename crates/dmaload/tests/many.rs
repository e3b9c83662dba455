//! Several files under one budget: order, bytes, summed progress, the
//! first failure stopping the rest (without touching the caller's token),
//! and the budget checked before anything is allocated.

mod common;

use std::sync::{Arc, Mutex};

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::{CancelToken, ErrorKind, LoadOptions};

#[test]
fn files_come_back_in_order_with_summed_progress() {
    let dir = scratch_dir();
    let sizes = [3u64 << 20, 1, 0, (5 << 20) + 77, 4096];
    let paths: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let path = dir.path().join(format!("shard{i}"));
            write_pattern_file(&path, size);
            path
        })
        .collect();
    let total: u64 = sizes.iter().sum();
    for concurrency in [1, 3, 8] {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        let options = LoadOptions {
            chunk_size: 1 << 20,
            progress: Some(Arc::new(move |done, all| seen.lock().unwrap().push((done, all)))),
            ..LoadOptions::default()
        };
        let loaded =
            dmaload::load_many(&paths, &options, concurrency, |path, options| dmaload::load(path, options))
                .unwrap();
        assert_eq!(loaded.len(), paths.len());
        for ((buffer, report), (&size, path)) in loaded.iter().zip(sizes.iter().zip(&paths)) {
            assert_eq!(buffer.len() as u64, size);
            assert_eq!(&report.path, path);
            assert_pattern(buffer, 0);
        }
        let calls = calls.lock().unwrap();
        assert!(calls.iter().all(|&(done, all)| all == total && done <= total), "{calls:?}");
        assert_eq!(calls.iter().map(|c| c.0).max(), Some(total), "{calls:?}");
    }
}

#[test]
fn the_first_failure_is_the_error_and_the_callers_token_stays_untouched() {
    let dir = scratch_dir();
    let mut paths = Vec::new();
    for i in 0..4 {
        let path = dir.path().join(format!("shard{i}"));
        write_pattern_file(&path, 8 << 20);
        paths.push(path);
    }
    let bad = dir.path().join("a-directory");
    std::fs::create_dir(&bad).unwrap();
    paths.insert(2, bad.clone());
    let token = CancelToken::new();
    let options = LoadOptions { cancel: token.clone(), ..LoadOptions::default() };
    let err =
        dmaload::load_many(&paths, &options, 2, |path, options| dmaload::load(path, options)).unwrap_err();
    assert_eq!(err.errno(), libc::EISDIR, "{err}");
    assert_eq!(err.path(), bad);
    assert!(!token.is_cancelled());
    // The caller's own cancellation still stops everything.
    token.cancel();
    let err = dmaload::load_many(&paths[..2], &options, 2, |path, options| dmaload::load(path, options))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
}

#[test]
fn files_that_cannot_fit_together_are_refused_before_loading() {
    let dir = scratch_dir();
    let available = dmaload::system::memory_available().unwrap();
    let paths: Vec<_> = (0..2)
        .map(|i| {
            let path = dir.path().join(format!("sparse{i}"));
            std::fs::File::create(&path).unwrap().set_len(available / 2 + (1 << 30)).unwrap();
            path
        })
        .collect();
    let err =
        dmaload::load_many(&paths, &LoadOptions::default(), 2, |path, options| dmaload::load(path, options))
            .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(err.to_string().contains("2 files need"), "{err}");
}

#[test]
fn safetensors_shards_load_with_their_headers() {
    let dir = scratch_dir();
    let mut paths = Vec::new();
    for i in 0..3u8 {
        let data = vec![i; 16 * (i as usize + 1)];
        let header = format!(
            r#"{{"t{i}":{{"dtype":"U8","shape":[{}],"data_offsets":[0,{}]}}}}"#,
            data.len(),
            data.len()
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&data);
        let path = dir.path().join(format!("m{i}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    let loaded = dmaload::load_many(&paths, &LoadOptions::default(), 2, |path, options| {
        dmaload::format::safetensors::load(path, options)
    })
    .unwrap();
    for (i, file) in loaded.iter().enumerate() {
        let t = file.header.tensor(&format!("t{i}")).unwrap();
        let start = (file.header.data_start() + t.data_offsets.0) as usize;
        assert!(file.buffer[start..start + t.byte_len() as usize].iter().all(|&b| b == i as u8));
    }
    std::fs::write(&paths[1], b"not a safetensors file").unwrap();
    assert!(dmaload::load_many(&paths, &LoadOptions::default(), 2, |path, options| {
        dmaload::format::safetensors::load(path, options)
    })
    .is_err());
}
