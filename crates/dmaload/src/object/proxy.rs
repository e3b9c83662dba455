//! HTTP proxies, from the variables curl and AWS's tools read:
//! `https_proxy`/`HTTPS_PROXY` for `https://` endpoints,
//! `http_proxy`/`HTTP_PROXY` for `http://` ones, `all_proxy`/`ALL_PROXY`
//! for either, and `no_proxy`/`NO_PROXY` for the hosts reached directly
//! (the lowercase form first, as curl reads them). Every connection through
//! a proxy is a `CONNECT` tunnel (TLS then runs inside it, end to end), with
//! the URL's `user:password` as `Proxy-Authorization: Basic`. Messages name
//! a proxy without its password.

use std::net::IpAddr;

/// The proxy settings of the environment.
#[derive(Debug, Clone, Default)]
pub struct Proxies {
    https: Option<Proxy>,
    http: Option<Proxy>,
    /// `no_proxy`'s entries, lowercase, without leading or trailing dots.
    bypass: Vec<String>,
}

/// One proxy: `http://[user[:password]@]host[:port]`.
#[derive(Clone)]
pub struct Proxy {
    pub host: String,
    pub port: u16,
    /// `Basic base64(user:password)`, when the URL names a user.
    authorization: Option<String>,
    /// The URL without its password, and the variable that set it.
    shown: String,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

impl Proxies {
    /// Reads the variables through `env`; an error names a variable whose
    /// URL cannot be used.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Proxies, String> {
        let first = |names: &[&'static str]| names.iter().find_map(|n| env(n).map(|v| (*n, v)));
        let proxy =
            |names: &[&'static str]| first(names).map(|(name, url)| Proxy::parse(name, &url)).transpose();
        let https = proxy(&["https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"])?;
        let http = proxy(&["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"])?;
        let bypass = first(&["no_proxy", "NO_PROXY"]).map_or_else(Vec::new, |(_, list)| {
            list.split([',', ' ', '\t'])
                .map(|entry| entry.trim().trim_matches('.').to_ascii_lowercase())
                .filter(|entry| !entry.is_empty())
                .collect()
        });
        Ok(Proxies { https, http, bypass })
    }

    /// The proxy a connection to `host:port` goes through, if any: the one
    /// of its scheme, unless `no_proxy` names the host.
    pub fn for_host(&self, host: &str, port: u16, https: bool) -> Option<&Proxy> {
        let proxy = if https { self.https.as_ref() } else { self.http.as_ref() }?;
        (!self.bypasses(host, port)).then_some(proxy)
    }

    /// Whether `no_proxy` names `host:port`, as curl matches it: `*` names
    /// every host; a name names itself and the names under it
    /// (`example.com`: `s3.example.com`, not `myexample.com`); an IP
    /// address, or a CIDR range (`10.0.0.0/8`), names the addresses in it
    /// (names are not resolved). An entry with `:PORT` names that port only
    /// (as Go's and Python's readers take it).
    fn bypasses(&self, host: &str, port: u16) -> bool {
        let host =
            host.trim_start_matches('[').trim_end_matches(']').trim_end_matches('.').to_ascii_lowercase();
        let address = host.parse::<IpAddr>().ok();
        self.bypass.iter().any(|entry| {
            if entry == "*" {
                return true;
            }
            let (name, wanted_port) = split_port(entry);
            if wanted_port.is_some_and(|p| p != port) {
                return false;
            }
            match (address, name.split_once('/')) {
                (Some(address), Some((net, bits))) => in_cidr(address, net, bits),
                (Some(address), None) => name.parse::<IpAddr>().is_ok_and(|n| n == address),
                (None, _) => host == name || host.strip_suffix(name).is_some_and(|h| h.ends_with('.')),
            }
        })
    }
}

/// `host:port` into its host and port; an IPv6 address (bracketed, or
/// bare with more than one colon) keeps its colons.
fn split_port(entry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = entry.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((address, port)) => (address, port.strip_prefix(':').and_then(|p| p.parse().ok())),
            None => (entry, None),
        };
    }
    match entry.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse() {
            Ok(port) => (host, Some(port)),
            Err(_) => (entry, None),
        },
        _ => (entry, None),
    }
}

/// Whether `address` is in `net/bits`.
fn in_cidr(address: IpAddr, net: &str, bits: &str) -> bool {
    let (Ok(net), Ok(bits)) = (net.parse::<IpAddr>(), bits.parse::<u32>()) else { return false };
    match (address, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) if bits <= 32 => {
            let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) if bits <= 128 => {
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

impl Proxy {
    /// `[http://][user[:password]@]host[:port][/]` from variable `name`;
    /// the port is 1080 when none is named, as curl takes it.
    fn parse(name: &str, url: &str) -> Result<Proxy, String> {
        let rest = match url.split_once("://") {
            None => url,
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
            Some((scheme, _)) => {
                return Err(format!(
                    "{name}: a {scheme}:// proxy is not supported (an http:// proxy is; TLS to the \
                     endpoint then runs inside its CONNECT tunnel)"
                ))
            }
        };
        let authority = rest.split('/').next().unwrap_or("");
        let (user, hostport) = match authority.rsplit_once('@') {
            Some((user, hostport)) => (Some(user), hostport),
            None => (None, authority),
        };
        let (host, port) = split_port(hostport);
        let names_port = match hostport.rfind(']') {
            Some(end) => hostport[end..].contains(':'),
            None => hostport.matches(':').count() == 1,
        };
        let port = match port {
            Some(port) => port,
            None if names_port => return Err(format!("{name}: the proxy URL's port is no port number")),
            None => 1080,
        };
        if host.is_empty() {
            return Err(format!("{name}: the proxy URL names no host"));
        }
        let host = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
        let authorization = user.map(|user| format!("Basic {}", base64(&percent_decode(user))));
        let who = user.map_or(String::new(), |u| format!("{}@", u.split(':').next().unwrap_or("")));
        Ok(Proxy { shown: format!("proxy http://{who}{host}:{port} ({name})"), host, port, authorization })
    }

    /// The request that asks the proxy for a tunnel to `host:port`.
    pub fn connect_request(&self, host: &str, port: u16) -> String {
        let mut head = format!("CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n");
        if let Some(authorization) = &self.authorization {
            head += &format!("Proxy-Authorization: {authorization}\r\n");
        }
        head + "\r\n"
    }

    /// Why a tunnel to `host:port` the proxy answered with `status` is
    /// refused (no 2xx, or a 2xx followed by bytes of the proxy's own),
    /// and what to check.
    pub fn refusal(&self, host: &str, port: u16, status: u16) -> String {
        let hint = match status {
            200..=299 => ": it sent bytes of its own after its answer",
            407 if self.authorization.is_none() => ": it wants credentials (http://USER:PASSWORD@HOST:PORT)",
            407 => ": it refused the credentials in its URL",
            403 => ": it does not allow this destination (or port), or set no_proxy for it",
            _ => "",
        };
        format!("{self:?} refused a tunnel to {host}:{port}: HTTP {status}{hint}")
    }

    /// Whether a refusal with `status` would be met again (no retry).
    pub fn refuses_for_good(status: u16) -> bool {
        matches!(status, 400..=499)
    }

    /// The proxy as messages name it (no password).
    pub fn shown(&self) -> &str {
        &self.shown
    }
}

/// `%XX` escapes of a URL's user part decoded (others left as they are).
fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex =
            bytes.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    out
}

/// Standard base64 with padding (RFC 4648), as Basic authentication wants.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(match i <= chunk.len() {
                true => ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char,
                false => '=',
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxies(vars: &[(&str, &str)]) -> Result<Proxies, String> {
        Proxies::from_env(&|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn the_variables_choose_a_proxy_by_scheme_lowercase_first() {
        let p = proxies(&[
            ("HTTPS_PROXY", "http://upper:3128"),
            ("https_proxy", "lower:8080"),
            ("HTTP_PROXY", "http://plain.example"),
        ])
        .unwrap();
        let https = p.for_host("s3.amazonaws.com", 443, true).unwrap();
        assert_eq!((https.host.as_str(), https.port), ("lower", 8080));
        let http = p.for_host("minio", 9000, false).unwrap();
        assert_eq!((http.host.as_str(), http.port), ("plain.example", 1080));
        let all = proxies(&[("ALL_PROXY", "http://[::1]:3128/")]).unwrap();
        assert_eq!(all.for_host("h", 80, false).unwrap().host, "[::1]");
        assert!(proxies(&[]).unwrap().for_host("h", 443, true).is_none());
        let socks = proxies(&[("https_proxy", "socks5://p:1080")]).unwrap_err();
        assert!(socks.starts_with("https_proxy: a socks5:// proxy is not supported"), "{socks}");
        assert!(proxies(&[("http_proxy", "http://p:port")]).unwrap_err().contains("no port number"));
    }

    #[test]
    fn credentials_in_the_url_are_sent_and_never_shown() {
        let p = proxies(&[("https_proxy", "http://helen:p%40ss:word@proxy:3128")]).unwrap();
        let proxy = p.for_host("h", 443, true).unwrap();
        // base64("helen:p@ss:word")
        assert!(proxy
            .connect_request("h", 443)
            .contains("\r\nProxy-Authorization: Basic aGVsZW46cEBzczp3b3Jk\r\n"));
        assert_eq!(proxy.shown(), "proxy http://helen@proxy:3128 (https_proxy)");
        let why = proxy.refusal("h", 443, 407);
        assert!(!why.contains("p%40ss") && !why.contains("p@ss") && why.contains("HTTP 407"), "{why}");
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn no_proxy_matches_as_curl_does() {
        let p = proxies(&[
            ("https_proxy", "p:3128"),
            ("http_proxy", "p:3128"),
            ("NO_PROXY", "Example.COM, .internal. ,10.0.0.0/8,192.168.1.7,minio:9000,[::1],fd00::/8"),
        ])
        .unwrap();
        let direct = |host: &str, port: u16| p.for_host(host, port, true).is_none();
        assert!(
            direct("example.com", 443) && direct("s3.example.com", 443) && direct("S3.EXAMPLE.COM.", 443)
        );
        assert!(!direct("myexample.com", 443) && !direct("example.com.evil", 443));
        assert!(direct("a.b.internal", 443) && direct("internal", 443));
        assert!(direct("10.1.2.3", 443) && !direct("11.1.2.3", 443));
        assert!(direct("192.168.1.7", 80) && !direct("192.168.1.8", 80));
        assert!(direct("minio", 9000) && !direct("minio", 9001));
        assert!(direct("[::1]", 443) && direct("[fd00::5]", 443) && !direct("[fe80::1]", 443));
        // Names are not resolved: an address's entry does not name a host.
        assert!(!direct("localhost", 443));
        let all = proxies(&[("https_proxy", "p:3128"), ("no_proxy", "*")]).unwrap();
        assert!(all.for_host("anything", 443, true).is_none());
        let lower_first = proxies(&[("https_proxy", "p"), ("no_proxy", "a"), ("NO_PROXY", "b")]).unwrap();
        assert!(
            lower_first.for_host("a", 443, true).is_none() && lower_first.for_host("b", 443, true).is_some()
        );
    }
}
