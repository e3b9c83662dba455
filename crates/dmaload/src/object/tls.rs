//! TLS for `https://` endpoints: `rustls` on the `ring` provider (pure
//! Rust and assembly: no OpenSSL at run time, no cmake to build), checking
//! the server's certificate against one set of trust roots: the bundle
//! `AWS_CA_BUNDLE` or the profile's `ca_bundle` names, else the system's
//! certificates, found as OpenSSL finds them (`SSL_CERT_FILE`,
//! `SSL_CERT_DIR`, else the distribution's store) by `rustls-native-certs`.
//!
//! Each source of roots is read once per process: its client
//! configuration is kept (a failed read is not, and is tried again) and
//! shared by every object opened with it, so the shards of a model read
//! their certificates once, and a connection to an endpoint may resume a
//! TLS session another object's connection began there (the configuration
//! holds `rustls`'s in-memory session store).

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore};

/// A file of PEM certificates that replaces the system's trust roots for
/// `https://` endpoints, and the setting that named it (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaBundle {
    pub path: PathBuf,
    /// `AWS_CA_BUNDLE`, or the profile's `ca_bundle` and its file.
    pub setting: String,
}

/// The source of a set of trust roots: a bundle's file, or the system's
/// certificates as the variables named then locate them.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Bundle(PathBuf),
    System(String),
}

/// The client configuration of each source read so far in this process.
static CONFIGS: Mutex<Vec<(Source, Arc<ClientConfig>)>> = Mutex::new(Vec::new());

/// The client side of TLS, shared by the connections of one object.
pub struct Tls {
    config: Arc<ClientConfig>,
    /// Where the trust roots came from, for messages.
    roots: String,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls").field("roots", &self.roots).finish_non_exhaustive()
    }
}

impl Tls {
    /// The client of the trust roots of `bundle` (its certificates only),
    /// else of the system's: read at the first call for that source in the
    /// process, the same configuration after. An error when none can be read.
    pub fn new(bundle: Option<&CaBundle>) -> Result<Tls, String> {
        let (source, roots) = match bundle {
            Some(bundle) => {
                (Source::Bundle(bundle.path.clone()), format!("{}={}", bundle.setting, bundle.path.display()))
            }
            None => (Source::System(system_roots()), system_roots()),
        };
        // Held while reading, so that shards opened at once read it once.
        let mut configs = CONFIGS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, config)) = configs.iter().find(|(read, _)| *read == source) {
            return Ok(Tls { config: config.clone(), roots });
        }
        let config = Arc::new(read_config(&source, &roots)?);
        configs.push((source, config.clone()));
        Ok(Tls { config, roots })
    }

    /// A new session with `host` (a name or an IP address, IPv6 in
    /// brackets), which its certificate must name.
    pub fn session(&self, host: &str) -> Result<ClientConnection, rustls::Error> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| rustls::Error::General(format!("{host:?} is no host name or address")))?;
        ClientConnection::new(self.config.clone(), name)
    }

    /// Why a handshake with `host:port` failed, and what to check.
    pub fn refusal(&self, host: &str, port: u16, err: &rustls::Error) -> String {
        let hint = match err {
            rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => {
                format!(" (trust roots: {})", self.roots)
            }
            rustls::Error::InvalidMessage(_) => {
                " (does the endpoint speak plain http:// instead?)".to_owned()
            }
            _ => String::new(),
        };
        format!("TLS handshake with {host}:{port} failed: {err}{hint}")
    }
}

/// Reads the trust roots of `source` (`roots` in messages) into a client
/// configuration; an error when none can be read.
fn read_config(source: &Source, roots: &str) -> Result<ClientConfig, String> {
    let found = match source {
        Source::Bundle(path) => rustls_native_certs::load_certs_from_paths(Some(path), None),
        Source::System(_) => rustls_native_certs::load_native_certs(),
    };
    let mut store = RootCertStore::empty();
    let (added, _unparsable) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        let why: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(format!(
            "an https:// endpoint needs trust roots, and none could be read from {roots}{}",
            if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) }
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS configuration: {e}"))?
        .with_root_certificates(store)
        .with_no_client_auth())
}

/// The system's trust roots, as messages name them.
fn system_roots() -> String {
    let set: Vec<String> = ["SSL_CERT_FILE", "SSL_CERT_DIR"]
        .iter()
        .filter_map(|var| Some(format!("{var}={}", std::env::var_os(var)?.to_string_lossy())))
        .collect();
    if set.is_empty() {
        "the system's certificates".to_owned()
    } else {
        set.join(", ")
    }
}
