//! Objects through the model-cache service: a real Garage
//! (the core's `tests/common/garage.rs`) and the service as this test binary run again
//! (`share/mod.rs`). The service reads an object with the
//! client's grant (presigned queries), keeps it under its ETag, and checks
//! the grant with a HEAD on every request, a hit's included. Without a
//! Garage binary each test says SKIP.

// The core's test helpers, shared rather than copied.
#[path = "../../dmaload/tests/common/mod.rs"]
mod common;
#[path = "../../dmaload/tests/common/garage.rs"]
mod garage;
mod share;

use std::time::Duration;

use common::scratch_dir;
use dmaload::object::Object;
use dmaload::share::protocol::{self, Reply};
use dmaload::share::{Connection, Served};
use dmaload::{CancelToken, ErrorKind, LoadOptions};
use dmaload_share::CacheOutcome;
use garage::{pattern, Garage};
use share::ServiceProcess;

/// Not a test of its own: this binary run again in a role (`share::process_role`).
#[test]
fn process_role() {
    share::process_role();
}

/// Bytes the process has read through `read(2)` and its kind, sockets
/// included (`rchar` of `/proc/PID/io`).
fn read_chars(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar: ")).unwrap().trim().parse().unwrap()
}

fn served(outcome: CacheOutcome) -> Served {
    match outcome {
        CacheOutcome::Service { served, .. } => served,
        CacheOutcome::Direct { reason } => panic!("loaded directly: {reason}"),
    }
}

#[test]
fn an_object_is_read_once_and_then_mapped_from_the_cache_under_its_etag() {
    let test = "an_object_is_read_once_and_then_mapped_from_the_cache_under_its_etag";
    let Some(garage) = Garage::start(test) else { return };
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let (v1, v2) = (pattern((8 << 20) + 4321, 1), pattern((8 << 20) + 4321, 2));
    garage.put("model.bin", &v1);
    let options = LoadOptions::default();

    let object = garage.open("model.bin").unwrap();
    let (buffer, report, outcome) =
        dmaload_share::CacheRequest::object(&object, &socket).options(&options).to_buffer().unwrap();
    assert_eq!(served(outcome), Served::Miss);
    assert!(buffer[..] == v1[..], "the first load's bytes differ from the object's");
    assert!(report.destination.starts_with("cache-service"), "{}", report.destination);

    // A restarted client: the service answers from its copy, with a HEAD
    // and no GET (what it reads from its sockets is far less than the object).
    let before = read_chars(service.pid());
    let object = garage.open("model.bin").unwrap();
    let (buffer, _, outcome) =
        dmaload_share::CacheRequest::object(&object, &socket).options(&options).to_buffer().unwrap();
    assert_eq!(served(outcome), Served::Hit);
    assert!(buffer[..] == v1[..], "the hit's bytes differ from the object's");
    let read = read_chars(service.pid()) - before;
    assert!(read < 1 << 20, "the service read {read} bytes to serve a cached object");

    // Another version of the object has another ETag: read again, never
    // the cached one.
    garage.put("model.bin", &v2);
    let object = garage.open("model.bin").unwrap();
    let (buffer, _, outcome) =
        dmaload_share::CacheRequest::object(&object, &socket).options(&options).to_buffer().unwrap();
    assert_eq!(served(outcome), Served::Miss);
    assert!(buffer[..] == v2[..], "the new version's bytes differ from the object's");
    let status = service.status();
    assert_eq!((status.hits, status.misses, status.files_cached), (1, 2, 2));
    assert!(status.files.iter().any(|f| f.path.to_string_lossy() == "s3://models/model.bin"), "{status:?}");
}

#[test]
fn an_object_replaced_after_the_client_opened_it_is_changed_and_nothing_is_returned() {
    let test = "an_object_replaced_after_the_client_opened_it_is_changed_and_nothing_is_returned";
    let Some(garage) = Garage::start(test) else { return };
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let _service = ServiceProcess::start(&socket, 1 << 30);
    garage.put("model.bin", &pattern(1 << 20, 1));
    let object = garage.open("model.bin").unwrap();
    garage.put("model.bin", &pattern(1 << 20, 2));
    let err = dmaload_share::CacheRequest::object(&object, &socket).to_buffer().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Changed, "{err}");
    assert!(err.to_string().contains("s3://models/model.bin"), "{err}");
}

/// Sends a get-object request for `grant` and returns the service's final
/// reply (after its acknowledgement and keepalives).
fn ask(socket: &std::path::Path, grant: &dmaload::object::Grant) -> Reply {
    let conn = Connection::connect(socket).unwrap();
    conn.set_timeouts(Some(Duration::from_secs(60))).unwrap();
    conn.send(&protocol::encode_object_request(grant), &[]).unwrap();
    loop {
        match protocol::receive_reply(&conn).unwrap().unwrap() {
            (Reply::Accepted | Reply::Working { .. }, _) => {}
            (reply, _) => return reply,
        }
    }
}

#[test]
fn a_grant_the_store_refuses_gets_nothing_even_when_the_object_is_cached() {
    let test = "a_grant_the_store_refuses_gets_nothing_even_when_the_object_is_cached";
    let Some(garage) = Garage::start(test) else { return };
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    garage.put("model.bin", &pattern(1 << 20, 1));
    let object = garage.open("model.bin").unwrap();
    let (_, _, outcome) = dmaload_share::CacheRequest::object(&object, &socket).to_buffer().unwrap();
    assert_eq!(served(outcome), Served::Miss);

    // The same object, the grant's signatures not the store's: no bytes.
    let mut forged = object.grant();
    for query in [&mut forged.head, &mut forged.get] {
        let (signed, _) = query.rsplit_once("X-Amz-Signature=").unwrap();
        *query = format!("{signed}X-Amz-Signature={}", "0".repeat(64));
    }
    match ask(&socket, &forged) {
        Reply::Error(err) => {
            let err = err.into_error(None);
            assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
            assert!(err.to_string().contains("s3://models/model.bin"), "{err}");
        }
        other => panic!("a forged grant got {other:?}"),
    }
    // A grant is untrusted input: what would break a request's head is refused.
    let mut smuggling = object.grant();
    smuggling.get += "\r\nx-injected: 1";
    match ask(&socket, &smuggling) {
        Reply::Error(err) => assert!(err.message.contains("no spaces or control characters"), "{err:?}"),
        other => panic!("a grant with a line break got {other:?}"),
    }
    assert_eq!(service.status().hits, 0);
}

#[test]
fn a_grant_carries_no_secret() {
    let test = "a_grant_carries_no_secret";
    let Some(garage) = Garage::start(test) else { return };
    garage.put("model.bin", &pattern(4096, 1));
    let object = Object::with_config(
        dmaload::object::ObjectUrl { bucket: garage::BUCKET.into(), key: "model.bin".into() },
        garage.config(),
        &CancelToken::new(),
    )
    .unwrap();
    let grant = object.grant();
    let wire = String::from_utf8(protocol::encode_object_request(&grant)).unwrap();
    assert!(!wire.contains(&garage.key.secret_key), "{wire}");
    assert!(wire.contains(&garage.key.access_key), "a grant names the key that signed it: {wire}");
    // What the grant opens is the object the client opened, at its version.
    let granted = Object::granted(&grant, &CancelToken::new()).unwrap();
    assert_eq!((granted.size, &granted.etag), (object.size, &object.etag));
}

#[test]
fn a_service_that_refuses_the_request_itself_is_passed_over_for_a_direct_load() {
    let test = "a_service_that_refuses_the_request_itself_is_passed_over_for_a_direct_load";
    let Some(garage) = Garage::start(test) else { return };
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let body = pattern((1 << 20) + 9, 3);
    garage.put("model.bin", &body);
    let object = garage.open("model.bin").unwrap();
    // What a service of before get-object answers: the request is not one it knows.
    let refused = dmaload::Error::new(
        ErrorKind::InvalidInput,
        "request",
        &socket,
        "malformed message: unknown variant `get-object`",
    );
    let reply = protocol::encode(&Reply::Error(protocol::WireError::from_error(&refused)));
    let fake = share::fake_service(&socket, vec![Some(reply)]);
    let (buffer, _, outcome) = dmaload_share::CacheRequest::object(&object, &socket).to_buffer().unwrap();
    fake.join().unwrap();
    assert!(buffer[..] == body[..], "the direct load's bytes differ from the object's");
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("unknown variant"), "{reason}"),
        other => panic!("{other:?}"),
    }
}
