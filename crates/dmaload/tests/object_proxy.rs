//! Loads from a real S3 server (Garage, `common/garage.rs`) through a real
//! HTTP proxy: a CONNECT proxy on 127.0.0.1 started by the test, which
//! counts the tunnels it opens, so each test sees whether the load went
//! through it. Without a Garage binary each test says SKIP.

#[path = "common/garage.rs"]
mod garage;
#[path = "common/tls_proxy.rs"]
mod tls_proxy;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dmaload::object::config::{CaBundle, Config, Endpoint, Proxies};
use dmaload::Loaded;
use garage::{pattern, Garage};
use tls_proxy::TlsProxy;

/// A CONNECT proxy on 127.0.0.1: it opens a tunnel to the host and port a
/// client asks for (with `Proxy-Authorization: want` when `want` is set,
/// else it answers 407) and counts the tunnels and refusals.
struct ConnectProxy {
    port: u16,
    tunnels: Arc<AtomicUsize>,
    refusals: Arc<AtomicUsize>,
}

impl ConnectProxy {
    fn start(want: Option<&'static str>) -> ConnectProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tunnels, refusals) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counts = (tunnels.clone(), refusals.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (tunnels, refusals) = (counts.0.clone(), counts.1.clone());
                std::thread::spawn(move || serve(client, want, &tunnels, &refusals));
            }
        });
        ConnectProxy { port, tunnels, refusals }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn tunnels(&self) -> usize {
        self.tunnels.load(Ordering::SeqCst)
    }
}

fn serve(mut client: TcpStream, want: Option<&str>, tunnels: &AtomicUsize, refusals: &AtomicUsize) {
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        if client.read(&mut byte).unwrap_or(0) == 0 {
            return;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let Some(target) = head.strip_prefix("CONNECT ").and_then(|rest| rest.split(' ').next()) else {
        let _ = client.write_all(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n");
        return;
    };
    if want.is_some_and(|want| !head.contains(&format!("\r\nProxy-Authorization: {want}\r\n"))) {
        refusals.fetch_add(1, Ordering::SeqCst);
        let _ = client.write_all(
            b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"t\"\r\n\
              Content-Length: 0\r\n\r\n",
        );
        return;
    }
    let Ok(upstream) = TcpStream::connect(target) else {
        let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n");
        return;
    };
    tunnels.fetch_add(1, Ordering::SeqCst);
    client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").unwrap();
    let (mut up_read, mut client_write) = (upstream.try_clone().unwrap(), client.try_clone().unwrap());
    let down = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_read, &mut client_write);
        let _ = client_write.shutdown(std::net::Shutdown::Write);
    });
    let mut upstream = upstream;
    let _ = std::io::copy(&mut client, &mut upstream);
    let _ = upstream.shutdown(std::net::Shutdown::Write);
    let _ = down.join();
}

/// `config` with the proxies `vars` set.
fn with_proxies(config: Config, vars: &[(&str, &str)]) -> Config {
    let proxies =
        Proxies::from_env(&|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())).unwrap();
    Config { proxies, ..config }
}

fn load(garage: &Garage, key: &str, config: Config) -> dmaload::Result<Vec<u8>> {
    let object = garage.open_with(key, config)?;
    match dmaload::LoadRequest::object(&object).load()?.0 {
        Loaded::Host(buffer) => Ok(buffer.to_vec()),
        other => panic!("not a host buffer: {other:?}"),
    }
}

#[test]
fn a_load_goes_through_the_proxy_and_no_proxy_bypasses_it() {
    let test = "a_load_goes_through_the_proxy_and_no_proxy_bypasses_it";
    let Some(garage) = Garage::start(test) else { return };
    let body = pattern((5 << 20) + 7, 21);
    garage.put("model.bin", &body);
    let proxy = ConnectProxy::start(None);
    let url = proxy.url();

    // http:// endpoint: http_proxy (never HTTPS_PROXY).
    let through =
        with_proxies(garage.config(), &[("http_proxy", &url), ("HTTPS_PROXY", "http://127.0.0.1:1")]);
    assert!(load(&garage, "model.bin", through).unwrap() == body);
    let tunnels = proxy.tunnels();
    assert!(tunnels >= 2, "the HEAD and the GETs went through the proxy: {tunnels} tunnels");

    // no_proxy names the endpoint (by address, by address and port, by
    // range): straight to the store.
    let port = garage.s3_port.to_string();
    for bypass in ["127.0.0.1".to_owned(), format!("127.0.0.1:{port}"), "127.0.0.0/8".into(), "*".into()] {
        let direct = with_proxies(garage.config(), &[("HTTP_PROXY", &url), ("NO_PROXY", &bypass)]);
        assert!(load(&garage, "model.bin", direct).unwrap() == body);
        assert_eq!(proxy.tunnels(), tunnels, "no_proxy={bypass} bypasses the proxy");
    }
    // An entry for another port, or a name (never resolved), does not.
    for other in [format!("127.0.0.1:{}", garage.s3_port + 1), "localhost".into()] {
        let proxied = with_proxies(garage.config(), &[("http_proxy", &url), ("no_proxy", &other)]);
        let before = proxy.tunnels();
        assert!(load(&garage, "model.bin", proxied).unwrap() == body);
        assert!(proxy.tunnels() > before, "no_proxy={other} leaves the endpoint proxied");
    }

    // https:// endpoint: TLS runs end to end inside the tunnel, the
    // certificate checked against the endpoint's name, not the proxy's.
    let Some(tls) = TlsProxy::start(test, garage.s3_port) else { return };
    let over_tls = Config {
        endpoint: Endpoint::parse(&tls.endpoint()).unwrap(),
        ca_bundle: Some(CaBundle { path: tls.ca(), setting: "AWS_CA_BUNDLE".into() }),
        ..garage.config()
    };
    let before = proxy.tunnels();
    let https = with_proxies(over_tls, &[("https_proxy", &url), ("http_proxy", "http://127.0.0.1:1")]);
    assert!(load(&garage, "model.bin", https).unwrap() == body);
    assert!(proxy.tunnels() > before, "the https:// load went through the proxy");
}

#[test]
fn a_proxy_gets_the_credentials_of_its_url_and_its_refusal_names_it_without_the_password() {
    let test = "a_proxy_gets_the_credentials_of_its_url";
    let Some(garage) = Garage::start(test) else { return };
    let body = pattern(3 << 20, 22);
    garage.put("model.bin", &body);
    // base64("loader:s3cr%t@x")
    let proxy = ConnectProxy::start(Some("Basic bG9hZGVyOnMzY3IldEB4"));
    let port = proxy.port;
    let quick = |config: Config| Config { retry_for: Duration::from_secs(2), ..config };

    let right = format!("http://loader:s3cr%25t%40x@127.0.0.1:{port}");
    let config = with_proxies(garage.config(), &[("http_proxy", &right)]);
    assert!(load(&garage, "model.bin", config).unwrap() == body);
    assert!(proxy.tunnels() >= 2);

    for (url, hint) in [
        (format!("http://127.0.0.1:{port}"), "it wants credentials"),
        (format!("http://loader:wrong-pass@127.0.0.1:{port}"), "it refused the credentials in its URL"),
    ] {
        let refusals = proxy.refusals.load(Ordering::SeqCst);
        let config = quick(with_proxies(garage.config(), &[("http_proxy", &url)]));
        let err = load(&garage, "model.bin", config).unwrap_err();
        let message = err.to_string();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{message}");
        let who = if url.contains('@') { "loader@" } else { "" };
        assert!(
            message.contains(&format!(
                "proxy http://{who}127.0.0.1:{port} (http_proxy) refused a tunnel to 127.0.0.1:{}: HTTP 407: {hint}",
                garage.s3_port
            )),
            "{message}"
        );
        assert!(!message.contains("wrong-pass"), "{message}");
        // A refusal is not retried.
        assert_eq!(proxy.refusals.load(Ordering::SeqCst), refusals + 1);
    }

    // A proxy nothing listens on: retried, then an error naming it.
    let gone = quick(with_proxies(garage.config(), &[("http_proxy", "http://u:hidden@127.0.0.1:1")]));
    let message = load(&garage, "model.bin", gone).unwrap_err().to_string();
    assert!(
        message.contains("proxy http://u@127.0.0.1:1 (http_proxy)") && !message.contains("hidden"),
        "{message}"
    );
}
