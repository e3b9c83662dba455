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
    dmaload::LoadRequest::path(&path)
        .options(&options)
        .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0))
        .unwrap();
    assert_eq!(dst, std::fs::read(&path).unwrap());
    flip_byte(&path, 6 * M as u64);
    let err = dmaload::LoadRequest::path(&path)
        .options(&options)
        .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0))
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

    // A line sha256sum -c passes over is named; a range cannot be verified.
    std::fs::write(dir.path().join("SHA256SUMS"), "not a digest  f\n").unwrap();
    let err = dmaload::load(&path, &options).unwrap_err();
    assert!(err.to_string().contains("passes over line(s) 1"), "{err}");
    coreutils_sums(dir.path(), &["f"]);
    let err = dmaload::LoadRequest::path(&path).range(0, M as u64).options(&options).to_buffer().unwrap_err();
    assert!(err.to_string().contains("cannot be checked against it"), "{err}");
    let mut dst = vec![0u8; M];
    let err = dmaload::LoadRequest::path(&path).options(&options).fill(&mut dst).unwrap_err();
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
    assert_eq!(dmaload::verify::sums_line(DigestKind::Blake3, &digest, b"model.bin"), b3sums.as_bytes());
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
        assert_eq!(dmaload::verify::sums_line(DigestKind::Sha256, &digest, name.as_bytes()), out.stdout);
    }
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

/// `load_into` of a whole file into the caller's memory verifies, on each
/// of its shapes: in place with unaligned edges read apart (hashed in file
/// order: head, body, tail), and through the staging ring (memory whose
/// alignment does not line up with the file); a flipped byte in the head
/// edge, the body or the tail edge fails with `Corrupt`. A part of the file
/// is refused before anything is read.
#[test]
fn load_into_the_callers_memory_verifies_a_whole_file() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    let len = 6 * M + 1234;
    write_pattern_file(&path, len as u64);
    coreutils_sums(dir.path(), &["model.bin"]);
    let page = 4096;
    // Memory from 100 bytes before a page boundary: a head edge of 100
    // bytes, a page-aligned body, an unaligned tail (in place, buffered);
    // and memory at an odd address with direct I/O (the staging ring).
    let mut backing = vec![0u8; len + 2 * page];
    let aligned = backing.as_ptr().align_offset(page);
    let shapes =
        [(aligned + page - 100, IoMode::Buffered), (aligned + 1, IoMode::Direct), (aligned, IoMode::Auto)];
    for (start, mode) in shapes {
        let options = verified(Engine::Uring, mode);
        let dst = &mut backing[start..start + len];
        dst.fill(0);
        dmaload::LoadRequest::path(&path)
            .options(&options)
            .fill(dst)
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(dst, &std::fs::read(&path).unwrap()[..], "{mode:?}");
    }
    for at in [10, 3 * M as u64, len as u64 - 7] {
        flip_byte(&path, at);
        for (start, mode) in shapes {
            let dst = &mut backing[start..start + len];
            let err = dmaload::LoadRequest::path(&path)
                .options(&verified(Engine::Uring, mode))
                .fill(dst)
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Corrupt, "{mode:?} at {at}: {err}");
        }
        flip_byte(&path, at);
    }
    // Not the whole file: refused before any read, with no sums file needed.
    std::fs::remove_file(dir.path().join("SHA256SUMS")).unwrap();
    let err = dmaload::LoadRequest::path(&path)
        .range(4096, None)
        .options(&verified(Engine::Uring, IoMode::Auto))
        .fill(&mut backing[..M])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("cannot be checked against it"), "{err}");
}

/// A safetensors file whose tensors are `lens` bytes each.
fn write_safetensors(path: &Path, lens: &[usize]) {
    let mut tensors = Vec::new();
    let mut at = 0;
    for (i, len) in lens.iter().enumerate() {
        tensors.push(format!(
            "\"t{i}\": {{\"dtype\": \"U8\", \"shape\": [{len}], \"data_offsets\": [{at}, {}]}}",
            at + len
        ));
        at += len;
    }
    let json = format!("{{{}}}", tensors.join(", "));
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend((0..at).map(|i| (i * 7 % 251) as u8));
    std::fs::write(path, bytes).unwrap();
}

/// The staged path to a device reads a safetensors header first, then
/// only the data section: the digest covers both, in file order (the head
/// the header was parsed from, then the data), so a verified load of the
/// data section checks the whole file, and a byte changed in the header
/// (still valid JSON) fails as one changed in the data does.
#[test]
fn a_staged_load_of_the_data_section_verifies_the_header_it_was_sized_from() {
    use dmaload::format::safetensors as st;
    let dir = scratch_dir();
    let path = dir.path().join("model.safetensors");
    write_safetensors(&path, &[3 * M + 5, M, 77]);
    coreutils_sums(dir.path(), &["model.safetensors"]);
    let load = |path: &Path| -> dmaload::Result<Vec<u8>> {
        let file = dmaload::OpenFile::open(path)?;
        let (header, _) = st::read_header_of(&file).map_err(|e| match e {
            st::Error::Io(e) => e,
            other => panic!("{other}"),
        })?;
        let mut dst = vec![0u8; header.data_len() as usize];
        let mut ring = StagingRing::new(3, M, 256 << 10).unwrap();
        let mut sink = HostSink::new(&mut dst, header.data_start());
        let options = verified(Engine::UringFixed, IoMode::Auto);
        dmaload::LoadRequest::open(&file)
            .range(header.data_start(), Some(header.data_len()))
            .options(&options)
            .to_sink(&mut ring, &mut sink)?;
        Ok(dst)
    };
    let data = load(&path).unwrap();
    assert_eq!(data, std::fs::read(&path).unwrap()[std::fs::read(&path).unwrap().len() - data.len()..]);
    // A blank in the JSON becomes a tab: the header still parses, to the
    // same tensors, but the file is not the one the sums file lists.
    let bytes = std::fs::read(&path).unwrap();
    let blank = bytes[8..].iter().position(|&b| b == b' ').unwrap() + 8;
    let mut changed = bytes.clone();
    changed[blank] = b'\t';
    std::fs::write(&path, &changed).unwrap();
    let err = load(&path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    std::fs::write(&path, &bytes).unwrap();
    flip_byte(&path, bytes.len() as u64 - 3);
    let err = load(&path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    // Without the header read first, the data section alone is a part of
    // the file: refused before any read.
    std::fs::write(&path, &bytes).unwrap();
    let file = dmaload::OpenFile::open(&path).unwrap();
    let mut dst = vec![0u8; M];
    let mut ring = StagingRing::new(3, M, 256 << 10).unwrap();
    let options = verified(Engine::UringFixed, IoMode::Auto);
    let start = bytes.len() as u64 - M as u64;
    let err = dmaload::LoadRequest::open(&file)
        .range(start, None)
        .options(&options)
        .to_sink(&mut ring, &mut HostSink::new(&mut dst, start))
        .unwrap_err();
    assert!(err.to_string().contains("cannot be checked against it"), "{err}");
}

/// What the real tool's `-c`, run in the sums file's directory, says of the
/// file a case is about: it checked it (a line `NAME: OK` for a file other
/// than `other`, which some cases list too) and nothing failed.
fn tool_checks(tool: &str, dir: &Path, sums: &str) -> bool {
    let out = Command::new(tool).args(["-c", sums]).current_dir(dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    out.status.success() && text.lines().any(|l| l.ends_with(": OK") && !l.starts_with("other:"))
}

/// A sums file means what `sha256sum -c` / `b3sum -c` say it means: for
/// each form below, written by hand around the tools' own lines, a
/// verified load succeeds exactly when the real tool's check does.
#[test]
fn sums_files_mean_what_sha256sum_c_and_b3sum_c_say() {
    let test = "sums_files_mean_what_sha256sum_c_and_b3sum_c_say";
    let dir = scratch_dir();
    let d = dir.path();
    std::fs::create_dir(d.join("sub")).unwrap();
    for name in ["model.bin", "other", "with space", " lead", "back\\slash", "new\nline", "sub/inner"] {
        write_pattern_file(&d.join(name), 300_000 + name.len() as u64);
    }
    std::os::unix::fs::symlink("model.bin", d.join("link")).unwrap();
    let line = |tool: &str, args: &[&str], name: &str| -> String {
        let out = Command::new(tool).args(args).arg(name).current_dir(d).output().unwrap();
        assert!(out.status.success(), "{tool} {name}");
        String::from_utf8(out.stdout).unwrap()
    };
    let wrong = |good: &str| -> String {
        // The same line with the digest's first digit changed.
        let at = usize::from(good.starts_with('\\'));
        let mut bytes = good.as_bytes().to_vec();
        bytes[at] = if bytes[at] == b'0' { b'1' } else { b'0' };
        String::from_utf8(bytes).unwrap()
    };
    let s = |name: &str| line("sha256sum", &[], name);
    let cases: Vec<(&str, String)> = vec![
        ("model.bin", s("model.bin")),
        ("model.bin", s("model.bin") + &s("model.bin")),
        ("model.bin", wrong(&s("model.bin")) + &s("model.bin")),
        ("model.bin", s("model.bin") + &wrong(&s("./model.bin"))),
        ("model.bin", s("model.bin").to_uppercase().replace("  MODEL.BIN", "  model.bin")),
        ("model.bin", s("model.bin").replace('\n', "\r\n") + &s("other").replace('\n', "\r\n")),
        ("model.bin", format!("# made by hand\n\n{}", s("model.bin"))),
        ("model.bin", format!("garbage line\n{}not hex  model.bin\n", s("model.bin"))),
        ("model.bin", line("sha256sum", &["--tag"], "model.bin")),
        ("model.bin", line("sha256sum", &["-b"], "./model.bin")),
        ("model.bin", s("model.bin").replacen("  ", " ", 1)),
        ("model.bin", s("other").replacen("  ", " ", 1) + &s("model.bin")),
        ("model.bin", s("other") + &s("model.bin").replacen("  ", " ", 1)),
        ("model.bin", "  ".to_owned() + &s("model.bin").replacen("  ", "\t", 1)),
        ("model.bin", s("model.bin").replace("model.bin", "model.bin ")),
        ("model.bin", s("sub/../model.bin")),
        ("with space", s("with space")),
        (" lead", s(" lead")),
        ("back\\slash", s("back\\slash") + &line("sha256sum", &["--tag"], "back\\slash")),
        ("new\nline", s("new\nline")),
        ("new\nline", line("sha256sum", &["--tag"], "new\nline")),
        ("link", s("link")),
        ("sub/inner", s("sub/inner")),
    ];
    for (i, (name, text)) in cases.iter().enumerate() {
        let sums = d.join("SHA256SUMS");
        // A file in `sub` is checked against a sums file in `sub` naming
        // it as the tool run there would open it.
        let (dir_of, text) = match name.strip_prefix("sub/") {
            Some(inner) => (d.join("sub"), text.replace("sub/inner", &format!("../sub/{inner}"))),
            None => (d.to_owned(), text.clone()),
        };
        let _ = std::fs::remove_file(&sums);
        let _ = std::fs::remove_file(d.join("sub/SHA256SUMS"));
        std::fs::write(dir_of.join("SHA256SUMS"), &text).unwrap();
        let tool = tool_checks("sha256sum", &dir_of, "SHA256SUMS");
        let ours = dmaload::load(d.join(name), &verified(Engine::Uring, IoMode::Auto));
        assert_eq!(
            ours.is_ok(),
            tool,
            "case {i} ({name:?}): {text:?}: sha256sum -c says {tool}, dmaload {:?}",
            ours.err()
        );
    }
    let _ = std::fs::remove_file(d.join("SHA256SUMS"));
    let _ = std::fs::remove_file(d.join("sub/SHA256SUMS"));

    if Command::new("b3sum").arg("--version").output().is_err() {
        return common::skip(test, "b3sum is not installed (apt-get install b3sum)");
    }
    let b = |name: &str| line("b3sum", &[], name);
    let cases: Vec<(&str, String)> = vec![
        ("model.bin", b("model.bin")),
        ("model.bin", b("model.bin") + &b("./model.bin")),
        ("model.bin", wrong(&b("model.bin")) + &b("model.bin")),
        ("model.bin", b("model.bin")[..64].to_uppercase() + &b("model.bin")[64..]),
        ("model.bin", b("model.bin").replace('\n', "\r\n")),
        ("model.bin", format!("# made by hand\n{}", b("model.bin"))),
        ("model.bin", format!("{}\n", b("model.bin"))),
        ("model.bin", b("model.bin").replacen("  ", " *", 1)),
        ("model.bin", format!("BLAKE3 (model.bin) = {}\n", &b("model.bin")[..64])),
        ("new\nline", b("new\nline")),
        ("back\\slash", b("back\\slash")),
        ("with space", b("with space")),
        ("link", b("link")),
    ];
    for (i, (name, text)) in cases.iter().enumerate() {
        std::fs::write(d.join("B3SUMS"), text).unwrap();
        let tool = tool_checks("b3sum", d, "B3SUMS");
        let ours = dmaload::load(d.join(name), &verified(Engine::Uring, IoMode::Auto));
        assert_eq!(
            ours.is_ok(),
            tool,
            "case {i} ({name:?}): {text:?}: b3sum -c says {tool}, dmaload {:?}",
            ours.err()
        );
    }
}
