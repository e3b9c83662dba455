//! TLS for `https://` endpoints: `rustls` on the `ring` provider (pure
//! Rust and assembly: no OpenSSL at run time, no cmake to build), checking
//! the server's certificate against one set of trust roots, read once per
//! opened object: the bundle `AWS_CA_BUNDLE` or the profile's `ca_bundle`
//! names, else the system's certificates, found as OpenSSL finds them
//! (`SSL_CERT_FILE`, `SSL_CERT_DIR`, else the distribution's store) by
//! `rustls-native-certs`.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore};

use super::config::CaBundle;

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
    /// Reads the trust roots: `bundle`'s certificates only when there is
    /// one, else the system's. An error when none can be read.
    pub fn new(bundle: Option<&CaBundle>) -> Result<Tls, String> {
        let (found, roots) = match bundle {
            Some(bundle) => (
                rustls_native_certs::load_certs_from_paths(Some(&bundle.path), None),
                format!("{}={}", bundle.setting, bundle.path.display()),
            ),
            None => (rustls_native_certs::load_native_certs(), system_roots()),
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
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS configuration: {e}"))?
            .with_root_certificates(store)
            .with_no_client_auth();
        Ok(Tls { config: Arc::new(config), roots })
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
