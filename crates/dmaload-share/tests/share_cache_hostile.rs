//! The cache service against hostile or failing peers, between real
//! processes: idle and forged connections, other users, exhausted
//! descriptors, broken or stopped services (each a fallback or a named
//! error), killed clients and services. The service and most clients are
//! this test binary run again in a role (`share/mod.rs`).

// The core's test helpers, shared rather than copied.
#[path = "../../dmaload/tests/common/mod.rs"]
mod common;
mod share;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_pattern, file_hash, scratch_dir, write_pattern_file};
use dmaload::share::protocol::{self, Reply, Request};
use dmaload::share::{Connection, Listener, Served};
use dmaload::{ErrorKind, LoadOptions};
use dmaload_share::service::{DEFAULT_IDLE_TIMEOUT, MAX_CLIENTS_PER_UID};
use dmaload_share::{CacheOutcome, Client, Service, ServiceConfig};
use share::*;

/// Not a test of its own: this binary run again in a role (`share::process_role`).
#[test]
fn process_role() {
    share::process_role();
}

#[test]
fn idle_connections_cannot_lock_a_client_out() {
    // One buggy process opens as many connections as the service serves
    // at once and never sends on them: the service closes them after its
    // idle timeout, and a client asking meanwhile is refused (and would
    // load directly) only until then, not for minutes.
    const MAX_CLIENTS: usize = 256;
    // Long enough for a loaded machine to start all their threads.
    const IDLE: Duration = Duration::from_secs(10);
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 1 << 20);
    let socket = dir.path().join("cache.sock");
    let mut cmd = role("service", &socket);
    cmd.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, IDLE.as_millis().to_string());
    let _service = ServiceProcess::start_with(&mut cmd, &socket);
    let idle: Vec<Connection> = (0..MAX_CLIENTS).map(|_| Connection::connect(&socket).unwrap()).collect();
    let started = Instant::now();
    // Their threads start in the service: full once a client is refused.
    let refused = |result: Result<(), dmaload::Error>| match result {
        Ok(()) => false,
        Err(err)
            if err.to_string().contains("clients are connected already")
                || err.to_string().contains("connections already, as many as one user may hold") =>
        {
            true
        }
        Err(err) => panic!("{err}"),
    };
    while !refused(Client::connect(&socket).and_then(|client| client.status()).map(drop)) {
        assert!(started.elapsed() < IDLE, "the idle connections did not fill the client slots");
        std::thread::sleep(Duration::from_millis(10));
    }
    let fetched = loop {
        let result = Client::connect(&socket).and_then(|client| client.get(&path));
        match result {
            Ok(fetched) => break fetched,
            Err(err) => assert!(refused(Err(err))),
        }
        assert!(started.elapsed() < 15 * IDLE, "refused for {:?} behind idle connections", started.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(fetched.served, Served::Miss);
    assert_pattern(&fetched.buffer, 0);
    // The service closed them: each reads as hung up (after the refusal
    // that those counted after the slots were full got).
    for conn in &idle {
        while conn.recv(&mut [0u8; 4096]).unwrap().0 > 0 {}
    }
}

#[test]
fn a_service_out_of_descriptors_logs_accept_failures_once_per_interval() {
    // Connections that hold every descriptor the service may open leave
    // the next ones waiting in the listen backlog, and accept failing
    // (EMFILE) every 50 ms: one line says so, not one per try, then one
    // line per 10 s while it lasts, and one when it works again.
    const NOFILE: u64 = 64;
    if !Command::new("prlimit").args(["--nofile=64", "true"]).status().is_ok_and(|s| s.success()) {
        return common::skip(
            "a_service_out_of_descriptors_logs_accept_failures_once_per_interval",
            "needs prlimit",
        );
    }
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let mut service_role = role("service", &socket);
    service_role.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, "600000");
    let mut cmd = through(&["prlimit", &format!("--nofile={NOFILE}")], &service_role);
    cmd.stderr(Stdio::piped());
    let mut service = ServiceProcess::start_with(&mut cmd, &socket);
    let (lines, log) = std::sync::mpsc::channel();
    let stderr = BufReader::new(service.child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if let Some(line) = line.strip_prefix("service: accept") {
                let _ = lines.send(line.to_owned());
            }
        }
    });
    let idle: Vec<Connection> = (0..NOFILE + 16).map(|_| Connection::connect(&socket).unwrap()).collect();
    let first = log.recv_timeout(Duration::from_secs(60)).expect("accept never failed");
    assert!(first.contains("Too many open files"), "{first}");
    // About 20 failed tries a second, none of them logged: every line up
    // to the first summary (10 s later) is a stretch's first failure or
    // the line saying accept works again (a descriptor the service frees
    // meanwhile, a departing probe's, makes one work again, and a new
    // stretch begins with a line).
    let mut lines = vec![first];
    let summary = loop {
        let line = log.recv_timeout(Duration::from_secs(60)).expect("no summary line");
        if line.starts_with(": still failing") {
            break line;
        }
        lines.push(line);
    };
    for pair in lines.windows(2) {
        assert!(pair[0].starts_with(" works again") || pair[1].starts_with(" works again"), "{lines:?}");
    }
    let tries: u64 = summary
        .strip_prefix(": still failing, ")
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{summary}"));
    assert!(tries > 1, "{summary}");
    drop(idle);
    let again = log.recv_timeout(Duration::from_secs(60)).expect("accept never worked again");
    assert!(again.starts_with(" works again, after "), "{again}");
    assert_eq!(service.status().files_cached, 0);
}

#[test]
fn forged_requests_are_refused_and_the_service_goes_on() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let conn = Connection::connect(&socket).unwrap();
    conn.set_timeouts(Some(Duration::from_secs(60))).unwrap();
    let ask = |bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]| -> String {
        conn.send(bytes, fds).unwrap();
        // A get is acknowledged before the service looks at its descriptor.
        let mut reply = protocol::receive_reply(&conn).unwrap().unwrap().0;
        if fds.len() == 1 {
            assert_eq!(reply, Reply::Accepted);
            reply = protocol::receive_reply(&conn).unwrap().unwrap().0;
        }
        match reply {
            Reply::Error(err) => {
                // A request that is not one is named by the service's socket.
                if err.op == "request" {
                    assert_eq!(Path::new(&err.path), socket, "{err:?}");
                }
                err.message
            }
            other => panic!("{other:?} for a forged request"),
        }
    };
    let get = protocol::encode_request(Request::Get);
    let directory = File::open(dir.path()).unwrap();
    let (sock_a, _sock_b) = Connection::pair().unwrap();
    // A pipe: the read end of a child's stdout.
    let mut sleeper = Command::new("sleep").arg("60").stdout(Stdio::piped()).spawn().unwrap();
    let pipe_r = sleeper.stdout.take().unwrap();
    let write_only = File::options().write(true).open(&path).unwrap();
    let o_path = File::options().read(true).custom_flags(libc::O_PATH).open(&path).unwrap();
    assert!(ask(&get, &[directory.as_fd()]).contains("directory, not a regular file"));
    assert!(ask(&get, &[sock_a.as_fd()]).contains("socket, not a regular file"));
    assert!(ask(&get, &[pipe_r.as_fd()]).contains("not a regular file"));
    assert!(ask(&get, &[write_only.as_fd()]).contains("not open for reading"));
    assert!(ask(&get, &[o_path.as_fd()]).contains("not open for reading"));
    assert!(ask(&get, &[]).contains("0 descriptors"));
    assert!(ask(b"{\"version\": 2, \"body\": {\"op\": \"get\", \"path\": \"/etc/shadow\"}}", &[])
        .contains("malformed"));
    assert!(ask(b"\xff\xfe", &[]).contains("malformed"));
    assert!(ask(&vec![b' '; 100_000], &[]).contains("longer than"));
    // A file that fails to load: the error the client gets is a direct load's.
    let proc_file = Path::new("/proc/self/status");
    let direct = dmaload::load(proc_file, &LoadOptions::default()).unwrap_err();
    let served = Client::connect(&socket).unwrap().get(proc_file).unwrap_err();
    assert_eq!((served.kind(), served.to_string()), (direct.kind(), direct.to_string()));
    // None of it broke the service or its connection.
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_pattern(&fetched.buffer, 0);
    assert!(ask(&get, &[directory.as_fd()]).contains("not a regular file"));
    let status = service.status();
    assert_eq!((status.errors, status.misses, status.files_cached), (11, 1, 1), "{status:?}");
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
}

#[test]
fn a_service_that_breaks_off_is_named_by_its_socket() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    // A service that reads each request, then hangs up or answers garbage.
    let service = fake_service(&socket, vec![None, Some(b"garbage".to_vec())]);
    for cause in ["closed the connection", "malformed message"] {
        let err = Client::connect(&socket).unwrap().get(&path).unwrap_err();
        assert_eq!((err.op(), err.path()), ("receive buffer", socket.as_path()), "{err}");
        assert!(err.to_string().contains(cause), "{err}");
    }
    service.join().unwrap();
}

/// A service out of descriptors, memory or threads of its own is a service
/// that cannot serve: the client loads the file itself, saying why. A file
/// that fails to load in the service fails the client's load alike.
#[test]
fn a_service_out_of_its_own_resources_is_a_fallback_a_failed_file_is_not() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    let error_reply = |errno, op| {
        let err = dmaload::Error::io(op, Path::new("model.bin"), std::io::Error::from_raw_os_error(errno));
        Some(protocol::encode(&Reply::Error(protocol::WireError::from_error(&err))))
    };
    let service = fake_service(
        &socket,
        vec![error_reply(libc::EMFILE, "allocate memory"), error_reply(libc::EIO, "read")],
    );
    let (buffer, _, outcome) = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).to_buffer())
        .unwrap();
    assert_pattern(&buffer, 0);
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("allocate memory"), "{reason}"),
        other => panic!("EMFILE in the service must load directly: {other:?}"),
    }
    let err = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).to_buffer())
        .unwrap_err();
    assert_eq!((err.op(), err.raw_os_error()), ("read", Some(libc::EIO)), "{err}");
    service.join().unwrap();
}

#[test]
fn another_user_is_refused() {
    if !can_become_nobody() {
        return common::skip("another_user_is_refused", "needs root and setpriv (util-linux)");
    }
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    // Let uid 65534 reach the socket and the file, so that the service's
    // SO_PEERCRED check, not the file mode, is what refuses it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let as_nobody = |socket: &Path| {
        let mut client = role("load-cached", socket);
        client.env(FILE, &path);
        let out = through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], &client)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        role_output(&String::from_utf8_lossy(&out.stdout))
    };
    // Refused, and the client loaded the file itself, saying why.
    let stdout = as_nobody(&socket);
    assert!(stdout.starts_with(&format!("direct {} (", file_hash(&path))), "{stdout}");
    assert!(stdout.contains("uid 65534 (gid 65534) is not served"), "{stdout}");
    let status = service.status();
    assert_eq!((status.refused, status.misses), (1, 0));

    // --allow-uid 65534: the service makes its directory and socket
    // reachable by others itself, and serves uid 65534 from the
    // descriptor it sent.
    let allowing = dir.path().join("shared").join("allowing.sock");
    let cmd = &mut role("service", &allowing);
    let service = ServiceProcess::start_with(cmd.env(LIMIT, "1000000000").env(ALLOW_UID, "65534"), &allowing);
    assert_eq!(as_nobody(&allowing), format!("service miss {}", file_hash(&path)));
    assert_eq!(service.status().refused, 0);

    // Its status names only the files it was handed, not one another user
    // had cached (a file uid 65534 cannot open).
    let private = dir.path().join("private.bin");
    write_pattern_file(&private, 50_000);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(Client::connect(&allowing).unwrap().get(&private).is_ok());
    let status = role("status", &allowing);
    let out =
        through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], &status).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        role_output(&String::from_utf8_lossy(&out.stdout)),
        format!("files=2 paths={}", path.display())
    );
    let all = service.status().files.iter().map(|f| f.path.clone()).collect::<Vec<_>>();
    assert_eq!(all, [private.clone(), path.clone()], "root sees every path");
}

#[test]
fn a_shared_socket_in_a_directory_others_cannot_enter_is_refused_at_bind() {
    let dir = scratch_dir();
    let closed = dir.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let config = |socket: PathBuf, allow_uids: Vec<u32>| ServiceConfig {
        socket,
        memory_limit: 1 << 20,
        allow_uids,
        allow_gids: Vec::new(),
        load_options: LoadOptions::default(),
        idle_timeout: DEFAULT_IDLE_TIMEOUT,
        log: Arc::new(|_| {}),
    };
    let err = Service::bind(config(closed.join("s.sock"), vec![65534])).err().expect("bound");
    assert!(err.to_string().contains("keeps other users out"), "{err}");
    // Serving only its own user, the same place is fine, and private.
    let service = Service::bind(config(closed.join("s.sock"), Vec::new())).unwrap();
    let mode = std::fs::metadata(service.socket()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn one_user_cannot_hold_every_client_slot() {
    if !can_become_nobody() {
        return common::skip("one_user_cannot_hold_every_client_slot", "needs root and setpriv (util-linux)");
    }
    let dir = scratch_dir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let mut cmd = role("service", &socket);
    cmd.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, "600000").env(ALLOW_UID, "65534");
    let service = ServiceProcess::start_with(&mut cmd, &socket);
    let nobody =
        |cmd: &Command| through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], cmd);
    let mut holder =
        nobody(&role("hold", &socket)).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    assert_eq!(read_role_line(&mut holder), format!("held {MAX_CLIENTS_PER_UID}"));
    // That user's next connection is refused, and says why...
    let out = nobody(role("load-cached", &socket).env(FILE, &path)).output().unwrap();
    let stdout = role_output(&String::from_utf8_lossy(&out.stdout));
    assert!(stdout.contains(&format!("uid 65534 has {MAX_CLIENTS_PER_UID} connections already")), "{stdout}");
    // ...while another user is served.
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_eq!(fetched.served, Served::Miss);
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    service.stop();
}

#[test]
fn a_service_whose_loads_read_nothing_is_a_fallback() {
    // A stand-in for a service that is alive (it acknowledges and keeps
    // sending keepalives) but whose load is stuck (a silent network or FUSE
    // server): its keepalives say no byte was read, and after
    // STALL_TIMEOUT the client loads directly, saying so.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    let listener = Listener::bind(&socket, 1).unwrap();
    let stuck = std::thread::spawn(move || {
        let conn = listener.accept().unwrap();
        conn.recv(&mut [0u8; 1024]).unwrap();
        conn.send(&protocol::encode(&Reply::Accepted), &[]).unwrap();
        // Until the client hangs up: the pace of a real service's keepalives.
        while conn.send(&protocol::encode(&Reply::Working { loaded: 7 }), &[]).is_ok() {
            std::thread::sleep(protocol::KEEPALIVE_INTERVAL);
        }
    });
    let (buffer, _, outcome) = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).to_buffer())
        .unwrap();
    assert_pattern(&buffer, 0);
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("have read nothing"), "{reason}"),
        other => panic!("a stuck service must load directly: {other:?}"),
    }
    stuck.join().unwrap();
}

#[test]
fn a_stopped_service_is_a_prompt_fallback() {
    // A service that accepted the connection (the kernel did, into the
    // backlog) but is stopped: the client hears no acknowledgement and
    // loads directly, saying so, instead of waiting for the reply.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let signal = |name: &str| {
        assert!(Command::new("kill").args([name, &service.pid().to_string()]).status().unwrap().success());
    };
    signal("-STOP");
    let client = role("load-cached", &socket).env(FILE, &path).stdout(Stdio::piped()).spawn().unwrap();
    let client_pid = client.id();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(client.wait_with_output().unwrap()));
    // Generous: the fallback comes after a few seconds, the old wait after 30 minutes.
    let out = finished.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
        let _ = Command::new("kill").args(["-KILL", &client_pid.to_string()]).status();
        signal("-CONT");
        panic!("the client still waited for a stopped service after 120 s");
    });
    signal("-CONT");
    let stdout = role_output(&String::from_utf8_lossy(&out.stdout));
    assert!(stdout.starts_with(&format!("direct {} (", file_hash(&path))), "{stdout}");
    assert!(stdout.contains("stopped or stuck"), "{stdout}");
    // Running again, it serves (a hit if it has meanwhile answered the
    // request the client gave up on).
    let again = run_client("load-cached", &socket, &path);
    assert!(again.starts_with("service ") && again.ends_with(&file_hash(&path).to_string()), "{again}");
    service.stop();
}

#[test]
fn killed_clients_and_a_killed_service_leak_nothing() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 64 << 20);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    // Clients killed while the service loads and sends: it goes on.
    for _ in 0..3 {
        let mut child = role("hang", &socket).env(FILE, &path).stdout(Stdio::piped()).spawn().unwrap();
        assert_eq!(read_role_line(&mut child), "sent");
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_pattern(&fetched.buffer, 0);
    // One memfd, the cached file's, however many clients died holding one
    // (the status request is a client itself).
    let started = Instant::now();
    while service.status().clients > 1 && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(service.memfds(), 1);
    assert_eq!(service.status().files_cached, 1);

    // The service killed: the memory it handed out stays valid, and the
    // next client loads directly, saying why.
    let mut service = service;
    service.child.kill().unwrap();
    service.child.wait().unwrap();
    assert_pattern(&fetched.buffer, 0);
    let line = run_client("load-cached", &socket, &path);
    assert!(line.starts_with(&format!("direct {} (no cache service: connect ", file_hash(&path))), "{line}");
    // A new service replaces the dead one's socket file.
    let service = ServiceProcess::start(&socket, 1 << 30);
    assert!(run_client("load-cached", &socket, &path).starts_with("service miss "));
    service.stop();
}

#[test]
fn a_running_service_is_not_replaced() {
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let _service = ServiceProcess::start(&socket, 1 << 20);
    let config = ServiceConfig {
        socket: socket.clone(),
        memory_limit: 1 << 20,
        allow_uids: Vec::new(),
        allow_gids: Vec::new(),
        load_options: LoadOptions::default(),
        idle_timeout: DEFAULT_IDLE_TIMEOUT,
        log: Arc::new(|_| {}),
    };
    let err = Service::bind(config.clone()).err().unwrap();
    assert!(err.to_string().contains("already listening"), "{err}");
    let not_socket = dir.path().join("file");
    File::create(&not_socket).unwrap();
    let err = Service::bind(ServiceConfig { socket: not_socket, ..config }).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
}
