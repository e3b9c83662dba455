//! Verified loads (`LoadOptions::verify`): every engine and both pipeline
//! shapes (in place, and through a staging ring into a sink) check the
//! bytes against the `SHA256SUMS` file beside the file, written by
//! coreutils' `sha256sum`, or the `B3SUMS` file written by `b3sum`; a
//! flipped byte, a missing sums file and an unlisted file are errors that
//! hand out no buffer.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{scratch_dir, write_pattern_file};
use dmaload::verify::DigestKind;
use dmaload::{Engine, ErrorKind, HostSink, IoMode, LoadOptions, StagingRing};

const M: usize = 1 << 20;

fn verified(engine: Engine, mode: IoMode) -> LoadOptions {
    LoadOptions {
        engine,
        mode,
        verify: true,
        gather_size: 2 * M,
        chunk_size: 256 << 10,
        ..LoadOptions::default()
    }
}

/// `sha256sum NAMES > SHA256SUMS` in `dir`: the sums come from coreutils,
/// not from the code under test.
fn coreutils_sums(dir: &Path, names: &[&str]) {
    let out = Command::new("sha256sum").args(names).current_dir(dir).output().unwrap();
    assert!(out.status.success());
    std::fs::write(dir.join("SHA256SUMS"), out.stdout).unwrap();
}

/// `b3sum NAMES > B3SUMS` in `dir`, or `false` (the test skipped, saying
/// why) where `b3sum` is not installed.
fn b3sum_sums(test: &str, dir: &Path, names: &[&str]) -> bool {
    match Command::new("b3sum").args(names).current_dir(dir).output() {
        Ok(out) => {
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            std::fs::write(dir.join("B3SUMS"), out.stdout).unwrap();
            true
        }
        Err(err) => {
            common::skip(test, &format!("b3sum cannot run ({err}); apt-get install b3sum"));
            false
        }
    }
}

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x20;
    std::fs::write(path, bytes).unwrap();
}

fn engines() -> [(Engine, IoMode); 4] {
    [
        (Engine::UringFixed, IoMode::Auto),
        (Engine::Uring, IoMode::Buffered),
        (Engine::PreadPool, IoMode::Auto),
        (Engine::Read, IoMode::Buffered),
    ]
}

#[test]
fn a_good_file_loads_and_one_flipped_byte_fails_naming_both_digests() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    let len = 9 * M as u64 + 4321;
    write_pattern_file(&path, len);
    std::fs::write(dir.path().join("other"), b"listed too").unwrap();
    coreutils_sums(dir.path(), &["other", "model.bin"]);
    for (engine, mode) in engines() {
        let (buffer, _) = dmaload::load(&path, &verified(engine, mode)).unwrap();
        assert_eq!(buffer.len() as u64, len);
    }
    let expected = std::fs::read_to_string(dir.path().join("SHA256SUMS")).unwrap();
    let expected = expected.lines().nth(1).unwrap()[..64].to_owned();
    // Past the first gather and inside the last: hashing covers every gather.
    for at in [5 * M as u64 + 17, len - 1] {
        flip_byte(&path, at);
        for (engine, mode) in engines() {
            let err = dmaload::load(&path, &verified(engine, mode)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{engine:?}: {err}");
            assert_eq!(err.errno(), libc::EBADMSG);
            let text = err.to_string();
            assert!(text.contains("model.bin") && text.contains(&expected), "{text}");
            let computed = Command::new("sha256sum").arg(&path).output().unwrap().stdout;
            assert!(text.contains(std::str::from_utf8(&computed[..64]).unwrap()), "{text}");
        }
        flip_byte(&path, at);
    }
    // Without verify, the same bytes load: the check is the option's.
    flip_byte(&path, 3);
    dmaload::load(&path, &LoadOptions::default()).unwrap();
}

#[test]
fn a_staged_load_into_a_sink_verifies_each_slot_as_it_is_delivered() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let len = 7 * M as u64 + 99;
    write_pattern_file(&path, len);
    coreutils_sums(dir.path(), &["f"]);
    let mut ring = StagingRing::new(3, M, 256 << 10).unwrap();
    let mut dst = vec![0u8; len as usize];
    let options = verified(Engine::UringFixed, IoMode::Auto);
    dmaload::load_to_sink(&path, 0, None, &mut ring, &mut HostSink::new(&mut dst, 0), &options).unwrap();
    assert_eq!(dst, std::fs::read(&path).unwrap());
    flip_byte(&path, 6 * M as u64);
    let err = dmaload::load_to_sink(&path, 0, None, &mut ring, &mut HostSink::new(&mut dst, 0), &options)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
}

#[test]
fn a_missing_sums_file_or_an_unlisted_file_is_an_error() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 3 * M as u64);
    let options = verified(Engine::UringFixed, IoMode::Auto);
    let err = dmaload::load(&path, &options).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("SHA256SUMS"), "{err}");

    std::fs::write(dir.path().join("g"), b"g").unwrap();
    coreutils_sums(dir.path(), &["g"]);
    let err = dmaload::load(&path, &options).unwrap_err();
    assert!(err.to_string().contains("\"f\" is not listed in"), "{err}");

    // A malformed line names the line; a range cannot be verified.
    std::fs::write(dir.path().join("SHA256SUMS"), "not a digest  f\n").unwrap();
    let err = dmaload::load(&path, &options).unwrap_err();
    assert!(err.to_string().contains("line 1"), "{err}");
    coreutils_sums(dir.path(), &["f"]);
    let err = dmaload::load_range(&path, 0, M as u64, &options).unwrap_err();
    assert!(err.to_string().contains("only a whole file"), "{err}");
    let mut dst = vec![0u8; M];
    let err = dmaload::load_into(&path, 0, &mut dst, &options).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
}

/// `B3SUMS` (BLAKE3, as `b3sum` writes it) is checked on every engine, is
/// preferred to `SHA256SUMS` when both list the file, and is passed over
/// for `SHA256SUMS` when it does not list the file.
#[test]
fn b3sums_written_by_b3sum_verify_and_come_first() {
    let test = "b3sums_written_by_b3sum_verify_and_come_first";
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    let len = 9 * M as u64 + 777;
    write_pattern_file(&path, len);
    if !b3sum_sums(test, dir.path(), &["model.bin"]) {
        return;
    }
    for (engine, mode) in engines() {
        let (buffer, _) = dmaload::load(&path, &verified(engine, mode)).unwrap();
        assert_eq!(buffer.len() as u64, len);
    }
    let digest = dmaload::verify::file_digest(&path, DigestKind::Blake3).unwrap();
    let b3sums = std::fs::read_to_string(dir.path().join("B3SUMS")).unwrap();
    assert_eq!(dmaload::verify::sums_line(&digest, "model.bin"), b3sums);
    assert_eq!(dmaload::verify::expected_digest(&path).unwrap(), (DigestKind::Blake3, digest));

    // Both list it, only B3SUMS is wrong: the load checks BLAKE3, and fails.
    coreutils_sums(dir.path(), &["model.bin"]);
    let wrong = format!("{}  model.bin\n", "0".repeat(64));
    std::fs::write(dir.path().join("B3SUMS"), &wrong).unwrap();
    let err = dmaload::load(&path, &verified(Engine::UringFixed, IoMode::Auto)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let text = err.to_string();
    assert!(text.contains("BLAKE3 mismatch") && text.contains("B3SUMS"), "{text}");
    assert!(text.contains(&dmaload::verify::hex(&digest)), "{text}");

    // B3SUMS lists other files only: SHA256SUMS, which lists it, decides.
    std::fs::write(dir.path().join("B3SUMS"), format!("{}  other\n", "0".repeat(64))).unwrap();
    dmaload::load(&path, &verified(Engine::Uring, IoMode::Buffered)).unwrap();
    flip_byte(&path, 5 * M as u64 + 3);
    let err = dmaload::load(&path, &verified(Engine::Uring, IoMode::Buffered)).unwrap_err();
    assert!(err.to_string().contains("SHA-256 mismatch"), "{err}");
    std::fs::remove_file(dir.path().join("SHA256SUMS")).unwrap();
    let err = dmaload::load(&path, &verified(Engine::Uring, IoMode::Buffered)).unwrap_err();
    assert!(err.to_string().contains("\"model.bin\" is not listed in"), "{err}");
}

/// `sha256sum`'s binary-mode marker (`*`), `./` names and escaped names
/// (a backslash in the name) are read as `sha256sum -c` reads them.
#[test]
fn sums_in_every_form_sha256sum_writes_are_read() {
    let dir = scratch_dir();
    let names = ["plain", "with space", "back\\slash"];
    for name in names {
        write_pattern_file(&dir.path().join(name), 100_000);
    }
    let modes: [&[&str]; 2] = [&["-b"], &[]];
    for args in modes {
        let mut listed: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        listed[0] = "./plain".into();
        let out =
            Command::new("sha256sum").args(args).args(&listed).current_dir(dir.path()).output().unwrap();
        std::fs::write(dir.path().join("SHA256SUMS"), out.stdout).unwrap();
        for name in names {
            let path: PathBuf = dir.path().join(name);
            dmaload::load(&path, &verified(Engine::Uring, IoMode::Auto)).unwrap();
        }
    }
    // The sums file's own line for each name is what sha256sum prints.
    for name in names {
        let digest = dmaload::verify::file_digest(&dir.path().join(name), DigestKind::Sha256).unwrap();
        let out = Command::new("sha256sum").arg(name).current_dir(dir.path()).output().unwrap();
        assert_eq!(dmaload::verify::sums_line(&digest, name).as_bytes(), out.stdout);
    }
}

/// A cached load with `verify` reads the file itself (the service does not
/// verify), says so, and still fails on a flipped byte.
#[test]
fn a_cached_load_with_verify_loads_directly_and_verifies() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 2 * M as u64 + 1);
    coreutils_sums(dir.path(), &["f"]);
    let socket = dir.path().join("no-service");
    let options = verified(Engine::UringFixed, IoMode::Auto);
    let (buffer, _, outcome) = dmaload::share::load_cached(&path, &socket, &options).unwrap();
    assert_eq!(buffer.len(), 2 * M + 1);
    match outcome {
        dmaload::share::CacheOutcome::Direct { reason } => {
            assert!(reason.contains("does not verify"), "{reason}")
        }
        dmaload::share::CacheOutcome::Service { .. } => panic!("a verified load was served"),
    }
    flip_byte(&path, M as u64);
    let err = dmaload::share::load_cached(&path, &socket, &options).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
}

/// A FIFO or a device named as the sums file, or as a file to sum, is
/// refused at once, never read forever (each call runs on a thread the test
/// gives up on after 30 s, so a regression fails instead of hanging).
#[test]
fn a_fifo_or_device_in_place_of_a_file_is_refused_not_read_forever() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let sums = dir.path().join(DigestKind::Sha256.sums_file());
    let within = |what: &str, call: Box<dyn FnOnce() -> String + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(call()).ok());
        let err =
            rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap_or_else(|_| panic!("{what} hung"));
        assert!(!err.is_empty(), "{what} was not refused");
        err
    };
    let load = |path: PathBuf| -> Box<dyn FnOnce() -> String + Send> {
        Box::new(move || {
            match dmaload::load(&path, &LoadOptions { verify: true, ..LoadOptions::default() }) {
                Ok(_) => String::new(),
                Err(err) => {
                    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
                    err.to_string()
                }
            }
        })
    };
    assert!(Command::new("mkfifo").arg(&sums).status().unwrap().success());
    let err = within("a FIFO sums file", load(path.clone()));
    assert!(err.contains("not a regular file"), "{err}");
    std::fs::remove_file(&sums).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &sums).unwrap();
    let err = within("/dev/zero as the sums file", load(path.clone()));
    assert!(err.contains("not a regular file"), "{err}");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let err = within(
        "summing a FIFO",
        Box::new(move || {
            dmaload::verify::file_digest(&fifo, DigestKind::Sha256)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        }),
    );
    assert!(err.contains("FIFO"), "{err}");
}
