//! Where an object store is and who we are to it, from the places AWS's own
//! tools read: the environment first, then the shared credentials and
//! config files of the profile (`AWS_PROFILE`, else `default`); keys, past
//! those, from the rest of AWS's default chain (`credentials`, a child of
//! this module: it imports this one's types, this one calls it).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

pub use super::proxy::Proxies;
pub use super::sigv4::Credentials;
pub use super::tls::CaBundle;
use super::tls::Tls;

mod credentials;

/// How a bucket is named in a request: in the path (`host/bucket/key`,
/// what custom endpoints such as Garage, MinIO and Ceph take by default) or
/// in the host name (`bucket.host/key`, AWS's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    Path,
    VirtualHosted,
}

/// An endpoint URL taken apart: `http(s)://host[:port][/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub https: bool,
    /// The host name or address (IPv6 in brackets).
    pub host: String,
    pub port: u16,
    /// Whether the port was named (the `Host` header then names it).
    explicit_port: bool,
    /// The URL's path, without a trailing `/` ("" for none).
    pub prefix: String,
    /// Whether the endpoint is AWS's own (virtual-hosted addressing then).
    pub aws: bool,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let (https, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err(format!("endpoint {url:?} is not an http:// or https:// URL"));
        };
        let (authority, prefix) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => {
                let port = port.parse::<u16>().map_err(|_| format!("endpoint {url:?} has a bad port"))?;
                (host, Some(port))
            }
            _ => (authority, None),
        };
        if host.is_empty() {
            return Err(format!("endpoint {url:?} names no host"));
        }
        Ok(Endpoint {
            https,
            host: host.to_owned(),
            port: port.unwrap_or(if https { 443 } else { 80 }),
            explicit_port: port.is_some(),
            prefix: match prefix.trim_matches('/') {
                "" => String::new(),
                path => format!("/{path}"),
            },
            aws: host.ends_with(".amazonaws.com"),
        })
    }

    /// The endpoint as a URL [`Endpoint::parse`] reads back.
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority(&self.host), self.prefix)
    }

    /// The `Host` header's value for `host` on this endpoint's port.
    pub fn authority(&self, host: &str) -> String {
        if self.explicit_port {
            format!("{host}:{}", self.port)
        } else {
            host.to_owned()
        }
    }
}

/// Everything a request needs besides the bucket and key.
#[derive(Debug, Clone)]
pub struct Config {
    /// `None`: requests go unsigned (a public bucket).
    pub credentials: Option<Credentials>,
    pub region: String,
    pub endpoint: Endpoint,
    pub addressing: Addressing,
    /// Time without a byte before a request is given up (and retried):
    /// `DMALOAD_S3_TIMEOUT` seconds, else 30.
    pub timeout: Duration,
    /// The most time one request spends on retries:
    /// `DMALOAD_S3_RETRY_SECONDS`, else 60.
    pub retry_for: Duration,
    /// The trust roots of an `https://` endpoint: `AWS_CA_BUNDLE`, else the
    /// profile's `ca_bundle`, else (`None`) the system's certificates.
    pub ca_bundle: Option<CaBundle>,
    /// The HTTP proxies of the environment (`https_proxy`, `no_proxy`...):
    /// connections to the store (and to STS) go through them.
    pub proxies: Proxies,
}

impl Config {
    /// Reads the configuration from the process's environment and the
    /// shared files; an error says which setting is wrong.
    pub fn from_env() -> Result<Config, String> {
        Config::from_lookup(&|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// [`Config::from_env`] with no keys, and none looked for (no process
    /// run, no endpoint asked): for requests another's grant authorizes.
    pub fn from_env_without_keys() -> Result<Config, String> {
        Config::read(&|name| std::env::var(name).ok().filter(|v| !v.is_empty()), false)
    }

    fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Config, String> {
        Config::read(env, true)
    }

    fn read(env: &dyn Fn(&str) -> Option<String>, keys: bool) -> Result<Config, String> {
        let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".to_owned());
        let home = env("HOME").map(PathBuf::from);
        let file = |var: &str, name: &str| {
            env(var).map(PathBuf::from).or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
        };
        let credentials_file =
            file("AWS_SHARED_CREDENTIALS_FILE", "credentials").map(|p| read_ini(&p)).unwrap_or_default();
        let config_file = file("AWS_CONFIG_FILE", "config").map(|p| read_ini(&p)).unwrap_or_default();
        let section = |ini: &HashMap<String, HashMap<String, String>>, name: &str| {
            ini.get(name).cloned().unwrap_or_default()
        };
        let creds = section(&credentials_file, &profile);
        // The config file names profiles `[profile NAME]`, except `[default]`.
        let conf = section(
            &config_file,
            &if profile == "default" { profile.clone() } else { format!("profile {profile}") },
        );
        let setting =
            |var: &str, key: &str| env(var).or_else(|| creds.get(key).or_else(|| conf.get(key)).cloned());
        let from_files = |key: &str| creds.get(key).or_else(|| conf.get(key)).cloned();

        let region = setting("AWS_REGION", "region")
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".to_owned());
        let endpoint_url = env("AWS_ENDPOINT_URL_S3")
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| conf.get("endpoint_url").cloned())
            .unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
        let endpoint = Endpoint::parse(&endpoint_url)?;
        let addressing = match env("DMALOAD_S3_ADDRESSING").as_deref() {
            Some("path") => Addressing::Path,
            Some("virtual") => Addressing::VirtualHosted,
            Some(other) => return Err(format!("DMALOAD_S3_ADDRESSING={other:?}: expected path or virtual")),
            None if endpoint.aws => Addressing::VirtualHosted,
            None => Addressing::Path,
        };
        let ca_bundle = match env("AWS_CA_BUNDLE") {
            Some(path) => Some(CaBundle { path: PathBuf::from(path), setting: "AWS_CA_BUNDLE".to_owned() }),
            None => conf.get("ca_bundle").map(|path| CaBundle {
                // As the AWS CLI reads it: `~/` is the home directory.
                path: match (path.strip_prefix("~/"), &home) {
                    (Some(rest), Some(home)) => home.join(rest),
                    _ => PathBuf::from(path),
                },
                setting: format!("ca_bundle of profile {profile}"),
            }),
        };
        let proxies = Proxies::from_env(env)?;

        // AWS's default chain, in its order (docs/object-storage.md).
        let credentials = match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
            _ if !keys => None,
            (Some(access_key), Some(secret_key)) => Some(Credentials {
                access_key,
                secret_key,
                session_token: env("AWS_SESSION_TOKEN"),
                source: "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".to_owned(),
            }),
            (Some(_), None) | (None, Some(_)) => {
                return Err("only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set".to_owned())
            }
            (None, None) => match credentials::WebIdentity::find(env, &from_files, &profile)? {
                Some(web) => {
                    // STS's endpoint as AWS's SDKs find it: its own
                    // variable, else the one for every service.
                    let url = env("AWS_ENDPOINT_URL_STS")
                        .or_else(|| env("AWS_ENDPOINT_URL"))
                        .or_else(|| conf.get("endpoint_url").cloned())
                        .unwrap_or_else(|| format!("https://sts.{region}.amazonaws.com"));
                    let sts = Endpoint::parse(&url).map_err(|e| web.failed(&e))?;
                    let tls = match sts.https {
                        true => Some(Tls::new(ca_bundle.as_ref()).map_err(|e| web.failed(&e))?),
                        false => None,
                    };
                    let proxy = proxies.for_host(&sts.host, sts.port, sts.https);
                    Some(web.assume_role(&sts, tls.as_ref(), proxy)?)
                }
                None => match (from_files("aws_access_key_id"), from_files("aws_secret_access_key")) {
                    (Some(access_key), Some(secret_key)) => Some(Credentials {
                        access_key,
                        secret_key,
                        session_token: from_files("aws_session_token"),
                        source: format!("profile {profile}'s aws_access_key_id"),
                    }),
                    _ => match from_files("credential_process") {
                        Some(command) => Some(credentials::from_process(&profile, &command)?),
                        None => match credentials::from_container(env)? {
                            Some(keys) => Some(keys),
                            None => credentials::from_imds(env)?,
                        },
                    },
                },
            },
        };
        let seconds = |name: &str, default: f64| {
            let secs = env(name).and_then(|v| v.parse::<f64>().ok()).filter(|s| *s > 0.0 && s.is_finite());
            Duration::from_secs_f64(secs.unwrap_or(default))
        };
        Ok(Config {
            credentials,
            region,
            endpoint,
            addressing,
            timeout: seconds("DMALOAD_S3_TIMEOUT", 30.0),
            retry_for: seconds("DMALOAD_S3_RETRY_SECONDS", 60.0),
            ca_bundle,
            proxies,
        })
    }
}

/// The sections of an INI file (`[name]`, then `key = value` lines), or
/// nothing when it cannot be read. Indented lines (a nested `s3 =` block)
/// are left out.
fn read_ini(path: &std::path::Path) -> HashMap<String, HashMap<String, String>> {
    let Ok(text) = std::fs::read_to_string(path) else { return HashMap::new() };
    parse_ini(&text)
}

fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut sections: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut current = None;
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.trim().to_owned());
            continue;
        }
        if let (Some(section), Some((key, value))) = (&current, line.split_once('=')) {
            let entry = sections.entry(section.clone()).or_default();
            entry.insert(key.trim().to_owned(), value.trim().to_owned());
        }
    }
    sections
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<Config, String> {
        // No probe of this machine's instance metadata service unless asked.
        let vars: HashMap<String, String> = [("AWS_EC2_METADATA_DISABLED", "true")]
            .iter()
            .chain(vars)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&|name| vars.get(name).cloned())
    }

    #[test]
    fn the_environment_names_keys_region_and_endpoint() {
        let c = config(&[
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "SK"),
            ("AWS_REGION", "garage"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:3900"),
        ])
        .unwrap();
        assert_eq!(c.region, "garage");
        assert_eq!(c.endpoint.authority(&c.endpoint.host), "127.0.0.1:3900");
        assert_eq!(c.addressing, Addressing::Path);
        assert!(!format!("{:?}", c).contains("SK"), "the secret never shows");
        let aws = config(&[("AWS_REGION", "eu-west-1")]).unwrap();
        assert_eq!(aws.endpoint.host, "s3.eu-west-1.amazonaws.com");
        assert_eq!(
            (aws.addressing, aws.endpoint.https, aws.endpoint.port),
            (Addressing::VirtualHosted, true, 443)
        );
        assert!(aws.credentials.is_none() && aws.ca_bundle.is_none());
        assert!(config(&[("AWS_ACCESS_KEY_ID", "AK")]).is_err());
        assert_eq!(config(&[("AWS_ENDPOINT_URL_S3", "http://h/p/")]).unwrap().endpoint.prefix, "/p");
    }

    #[test]
    fn profiles_come_from_the_shared_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("credentials"),
            "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n[dev]\naws_access_key_id=K\naws_secret_access_key=S\naws_session_token = T\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("config"),
            "[profile dev]\nregion = r1\nca_bundle = ~/certs/ca.pem\nendpoint_url = http://localhost:9000\ns3 =\n  addressing_style = virtual\n",
        )
        .unwrap();
        let home = dir.path().to_str().unwrap().replace("/.aws", "");
        let credentials = dir.path().join("credentials");
        let conf = dir.path().join("config");
        let c = config(&[
            ("HOME", &home),
            ("AWS_PROFILE", "dev"),
            ("AWS_SHARED_CREDENTIALS_FILE", credentials.to_str().unwrap()),
            ("AWS_CONFIG_FILE", conf.to_str().unwrap()),
        ])
        .unwrap();
        let creds = c.credentials.unwrap();
        assert_eq!((creds.access_key.as_str(), creds.session_token.as_deref()), ("K", Some("T")));
        assert_eq!((c.region.as_str(), c.endpoint.port), ("r1", 9000));
        let bundle = c.ca_bundle.unwrap();
        assert_eq!(bundle.path, std::path::Path::new(&home).join("certs/ca.pem"));
        assert_eq!(bundle.setting, "ca_bundle of profile dev");
        let d = config(&[("AWS_SHARED_CREDENTIALS_FILE", credentials.to_str().unwrap())]).unwrap();
        assert_eq!(d.credentials.unwrap().access_key, "D");
        // AWS_CA_BUNDLE outranks the profile's.
        let e = config(&[
            ("AWS_CONFIG_FILE", conf.to_str().unwrap()),
            ("AWS_PROFILE", "dev"),
            ("AWS_CA_BUNDLE", "/etc/ca.pem"),
        ])
        .unwrap();
        assert_eq!(e.ca_bundle.unwrap().path, std::path::Path::new("/etc/ca.pem"));
    }

    /// A stand-in credentials endpoint on 127.0.0.1 that answers one
    /// request with `body`, and hands back the request's head.
    fn serve_once(status: &'static str, body: &'static str) -> (String, std::thread::JoinHandle<String>) {
        let (url, served) = serve(vec![(status, body)]);
        (url, std::thread::spawn(move || served.join().unwrap().remove(0)))
    }

    /// [`serve_once`] for a request per reply, each on its own connection,
    /// in turn: the requests (heads and bodies).
    fn serve(replies: Vec<(&'static str, &'static str)>) -> (String, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/creds", listener.local_addr().unwrap());
        let served = std::thread::spawn(move || {
            let mut requests = Vec::new();
            for (status, body) in replies {
                let (mut stream, _) = listener.accept().unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
                    head.push(byte[0]);
                }
                // The request's body after its head, by its Content-Length.
                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                let len =
                    text.split("content-length: ").nth(1).and_then(|v| v.split('\r').next()?.parse().ok());
                let mut sent = vec![0u8; len.unwrap_or(0)];
                stream.read_exact(&mut sent).unwrap();
                head.extend(sent);
                let reply = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                stream.write_all(reply.as_bytes()).unwrap();
                requests.push(String::from_utf8(head).unwrap());
            }
            requests
        });
        (url, served)
    }

    #[test]
    fn keys_come_from_the_environment_the_profile_a_process_a_container_then_the_instance() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("creds.sh");
        std::fs::write(
            &script,
            "#!/bin/sh\necho '{\"Version\": 1, \"AccessKeyId\": \"PK\", \"SecretAccessKey\": \"PS\"}'\n",
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let conf = |text: String| {
            let path = dir.path().join(format!("config{}", text.len()));
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_owned()
        };
        // A container endpoint nothing listens on, and a metadata service
        // that records whether it was asked.
        let refused = "http://127.0.0.1:1/creds";
        let imds = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        imds.set_nonblocking(true).unwrap();
        let imds_url = format!("http://{}", imds.local_addr().unwrap());
        let asked = || imds.accept().is_ok();
        let broken_process = conf("[default]\ncredential_process = /nonexistent/creds\n".into());
        let keyed = conf("[default]\naws_access_key_id = FK\naws_secret_access_key = FS\ncredential_process = /nonexistent/creds\n".into());
        let process = conf(format!("[default]\ncredential_process = {}\n", script.display()));
        let keys = |vars: &[(&str, &str)]| config(vars).map(|c| c.credentials.map(|k| k.access_key));

        let env_first =
            [("AWS_ACCESS_KEY_ID", "EK"), ("AWS_SECRET_ACCESS_KEY", "ES"), ("AWS_CONFIG_FILE", &keyed)];
        assert_eq!(keys(&env_first).unwrap().as_deref(), Some("EK"));
        // The profile's keys: its process is not run, no endpoint asked.
        let profile = [("AWS_CONFIG_FILE", keyed.as_str()), ("AWS_CONTAINER_CREDENTIALS_FULL_URI", refused)];
        assert_eq!(keys(&profile).unwrap().as_deref(), Some("FK"));
        let process_first =
            [("AWS_CONFIG_FILE", process.as_str()), ("AWS_CONTAINER_CREDENTIALS_FULL_URI", refused)];
        assert_eq!(keys(&process_first).unwrap().as_deref(), Some("PK"));
        let why = keys(&[("AWS_CONFIG_FILE", &broken_process)]).unwrap_err();
        assert!(
            why.contains("credential_process of profile default (/nonexistent/creds): cannot run it"),
            "{why}"
        );

        let (url, served) = serve_once(
            "200 OK",
            r#"{"AccessKeyId":"CK","SecretAccessKey":"CS","Token":"CT","Expiration":"2999-01-01T00:00:00Z"}"#,
        );
        let container = [
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", url.as_str()),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "Basic abc"),
            ("AWS_EC2_METADATA_DISABLED", "false"),
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds_url),
        ];
        let c = config(&container).unwrap().credentials.unwrap();
        assert_eq!((c.access_key.as_str(), c.session_token.as_deref()), ("CK", Some("CT")));
        let head = served.join().unwrap();
        assert!(
            head.starts_with("GET /creds HTTP/1.1\r\n") && head.contains("\r\nAuthorization: Basic abc\r\n"),
            "{head}"
        );
        assert!(!asked(), "the metadata service is asked only when nothing else gave keys");
        let why = keys(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", refused)]).unwrap_err();
        assert!(
            why.starts_with(
                "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI=http://127.0.0.1:1/creds)"
            ),
            "{why}"
        );
        let remote = keys(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://example.com/creds")]).unwrap_err();
        assert!(remote.contains("only http:// to"), "{remote}");

        // Nothing gave keys: the metadata service is asked; where nothing
        // answers, requests go unsigned.
        let imds_only =
            [("AWS_EC2_METADATA_DISABLED", "false"), ("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds_url)];
        let probe = std::thread::spawn({
            let listener = imds.try_clone().unwrap();
            move || {
                listener.set_nonblocking(false).unwrap();
                drop(listener.accept().unwrap());
            }
        });
        assert_eq!(keys(&imds_only).unwrap(), None);
        probe.join().unwrap();
        let nobody = [("AWS_EC2_METADATA_DISABLED", "false"), ("AWS_EC2_METADATA_SERVICE_ENDPOINT", refused)];
        assert_eq!(keys(&nobody).unwrap(), None);
        // Another cloud's metadata service at the address: no token, no keys.
        let (other, served) = serve_once("404 Not Found", "");
        let other = other.trim_end_matches("/creds");
        let elsewhere =
            [("AWS_EC2_METADATA_DISABLED", "false"), ("AWS_EC2_METADATA_SERVICE_ENDPOINT", other)];
        assert_eq!(keys(&elsewhere).unwrap(), None);
        assert!(served.join().unwrap().starts_with("PUT /latest/api/token HTTP/1.1\r\n"));
    }

    /// STS's documented answer to AssumeRoleWithWebIdentity.
    const STS_OK: &str = "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\
        <AssumeRoleWithWebIdentityResult><SubjectFromWebIdentityToken>system:serviceaccount:ml:loader</SubjectFromWebIdentityToken>\
        <Credentials><SessionToken>WT</SessionToken><SecretAccessKey>WS</SecretAccessKey>\
        <Expiration>2999-01-01T00:00:00Z</Expiration><AccessKeyId>WK</AccessKeyId></Credentials>\
        </AssumeRoleWithWebIdentityResult><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata>\
        </AssumeRoleWithWebIdentityResponse>";

    #[test]
    fn a_web_identity_token_is_exchanged_at_sts_after_the_environment_keys_and_before_the_profile() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "eyJ.TOKEN-never-shown.sig\n").unwrap();
        let token = token.to_str().unwrap();
        let role = "arn:aws:iam::123456789012:role/loader";
        let keyed = dir.path().join("config");
        std::fs::write(&keyed, "[default]\naws_access_key_id = FK\naws_secret_access_key = FS\n").unwrap();
        let keyed = keyed.to_str().unwrap();
        let keys = |vars: &[(&str, &str)]| config(vars).map(|c| c.credentials.unwrap());

        let (url, served) = serve_once("200 OK", STS_OK);
        let sts = url.trim_end_matches("/creds");
        let vars = [
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
            ("AWS_ROLE_SESSION_NAME", "s1"),
            ("AWS_ENDPOINT_URL_STS", sts),
            ("AWS_CONFIG_FILE", keyed),
        ];
        let c = keys(&vars).unwrap();
        assert_eq!(
            (c.access_key.as_str(), c.secret_key.as_str(), c.session_token.as_deref()),
            ("WK", "WS", Some("WT"))
        );
        assert_eq!(c.source, format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, role {role})"));
        let request = served.join().unwrap();
        assert!(request.starts_with("POST / HTTP/1.1\r\n"), "{request}");
        assert!(request.contains("\r\nContent-Type: application/x-www-form-urlencoded\r\n"), "{request}");
        assert!(
            request.ends_with(
                "\r\n\r\nAction=AssumeRoleWithWebIdentity&Version=2011-06-15\
                 &RoleArn=arn%3Aaws%3Aiam%3A%3A123456789012%3Arole%2Floader&RoleSessionName=s1\
                 &WebIdentityToken=eyJ.TOKEN-never-shown.sig"
            ),
            "{request}"
        );

        // The environment's keys come first: STS (nothing listens) is not asked.
        let env_first = [
            ("AWS_ACCESS_KEY_ID", "EK"),
            ("AWS_SECRET_ACCESS_KEY", "ES"),
            ("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:1"),
        ];
        let with_env: Vec<_> =
            vars.iter().copied().filter(|(k, _)| *k != "AWS_ENDPOINT_URL_STS").chain(env_first).collect();
        assert_eq!(keys(&with_env).unwrap().access_key, "EK");

        // A profile's settings, its session named for us.
        let (url, served) = serve_once("200 OK", STS_OK);
        let profile = dir.path().join("profile");
        std::fs::write(
            &profile,
            format!(
                "[profile irsa]\nweb_identity_token_file = {token}\nrole_arn = {role}\nendpoint_url = {}\n",
                url.trim_end_matches("/creds")
            ),
        )
        .unwrap();
        let profile = profile.to_str().unwrap();
        let c = keys(&[("AWS_CONFIG_FILE", profile), ("AWS_PROFILE", "irsa")]).unwrap();
        assert_eq!(c.source, format!("web identity (web_identity_token_file of profile irsa, role {role})"));
        assert!(served.join().unwrap().contains("&RoleSessionName=dmaload-"));

        // STS's refusal names the operation, the role and STS's code, never the token.
        let (url, served) = serve_once(
            "400 Bad Request",
            "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type>\
             <Code>InvalidIdentityToken</Code><Message>Incorrect token audience</Message></Error>\
             <RequestId>r</RequestId></ErrorResponse>",
        );
        let refused = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        let why = keys(&refused).unwrap_err();
        served.join().unwrap();
        assert!(
            why.starts_with(&format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE={token}, role {role}): AssumeRoleWithWebIdentity at http://127.0.0.1:"))
                && why.ends_with("HTTP 400 InvalidIdentityToken: Incorrect token audience"),
            "{why}"
        );
        assert!(!why.contains("TOKEN-never-shown"), "{why}");
        // Keys already expired, or an answer without them, are refused.
        let (url, served) = serve_once("200 OK", "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials><AccessKeyId>K</AccessKeyId><SecretAccessKey>S</SecretAccessKey><SessionToken>T</SessionToken><Expiration>2001-01-01T00:00:00Z</Expiration></Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>");
        let expired = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        assert!(keys(&expired).unwrap_err().ends_with("its keys expired at 2001-01-01T00:00:00Z"));
        served.join().unwrap();
        let (url, served) = serve_once("200 OK", "<html>a captive portal</html>");
        let portal = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        assert!(keys(&portal).unwrap_err().ends_with("its answer names no Credentials/AccessKeyId"));
        served.join().unwrap();

        // STS's own trouble (a 5xx, IDPCommunicationError) is tried again,
        // up to three times in all.
        let idp = "<ErrorResponse><Error><Code>IDPCommunicationError</Code><Message>try again</Message></Error></ErrorResponse>";
        let (url, served) =
            serve(vec![("503 Service Unavailable", ""), ("400 Bad Request", idp), ("200 OK", STS_OK)]);
        let flaky = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        assert_eq!(keys(&flaky).unwrap().access_key, "WK");
        assert_eq!(served.join().unwrap().len(), 3);
        let echo = "<ErrorResponse><Error><Code>InvalidIdentityToken</Code><Message>bad eyJ.TOKEN-never-shown.sig</Message></Error></ErrorResponse>";
        let (url, served) = serve_once("400 Bad Request", echo);
        let echoed = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        assert!(keys(&echoed).unwrap_err().ends_with("HTTP 400 InvalidIdentityToken: bad <the token>"));
        served.join().unwrap();
        let (url, served) = serve(vec![("400 Bad Request", idp); 3]);
        let failing = [
            ("AWS_ENDPOINT_URL_STS", url.trim_end_matches("/creds")),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        let why = keys(&failing).unwrap_err();
        assert!(why.ends_with("HTTP 400 IDPCommunicationError: try again (3 attempts)"), "{why}");
        served.join().unwrap();

        // STS is asked through the proxy of its scheme: a CONNECT to its
        // host (never resolved here), and the proxy's refusal is not retried.
        let (proxy, asked) = serve_once("407 Proxy Authentication Required", "");
        let proxy = proxy.trim_end_matches("/creds");
        let proxied = [
            ("AWS_ENDPOINT_URL_STS", "http://sts.example:8080"),
            ("http_proxy", proxy),
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token),
            ("AWS_ROLE_ARN", role),
        ];
        let why = keys(&proxied).unwrap_err();
        let refused = format!(
            "proxy {proxy} (http_proxy) refused a tunnel to sts.example:8080: HTTP 407: it wants credentials"
        );
        assert!(why.contains(&refused) && !why.ends_with("attempts)"), "{why}");
        assert!(asked
            .join()
            .unwrap()
            .starts_with("CONNECT sts.example:8080 HTTP/1.1\r\nHost: sts.example:8080\r\n"));

        // A token file without a role is an error; a role without a token
        // file (a source_profile's) is no web identity.
        let why = keys(&[("AWS_WEB_IDENTITY_TOKEN_FILE", token)]).unwrap_err();
        assert!(why.ends_with("no role to assume (set AWS_ROLE_ARN or role_arn)"), "{why}");
        assert!(config(&[("AWS_ROLE_ARN", role)]).unwrap().credentials.is_none());
    }

    /// A token file that is a FIFO is refused at once (never waited on),
    /// one larger than STS takes is refused unread, and STS is not asked.
    #[test]
    fn a_web_identity_token_file_that_is_a_fifo_or_too_large_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let large = dir.path().join("large");
        std::fs::write(&large, vec![b'a'; 100 << 10]).unwrap();
        for (file, why) in [(&fifo, "not a regular file"), (&large, "longer than 65536 bytes")] {
            let file = file.to_str().unwrap();
            let err = config(&[
                ("AWS_WEB_IDENTITY_TOKEN_FILE", file),
                ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
                ("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:1"),
            ])
            .unwrap_err();
            assert_eq!(
                err,
                format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE={file}, role arn:aws:iam::1:role/r): {file}: {why}")
            );
        }
    }

    /// The link-local credential services are asked directly even where a
    /// proxy is set for every host, as AWS's SDKs ask them.
    #[test]
    fn credential_services_are_never_asked_through_a_proxy() {
        let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        proxy.set_nonblocking(true).unwrap();
        let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
        let (url, served) =
            serve_once("200 OK", r#"{"AccessKeyId":"CK","SecretAccessKey":"CS","Token":"CT"}"#);
        let c = config(&[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &url),
            ("http_proxy", &proxy_url),
            ("HTTPS_PROXY", &proxy_url),
            ("ALL_PROXY", &proxy_url),
        ])
        .unwrap();
        served.join().unwrap();
        assert_eq!(
            c.credentials.unwrap().source,
            "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI)"
        );
        // The instance metadata service too (a 404 to its token: no keys).
        let (imds, served) = serve_once("404 Not Found", "");
        let c = config(&[
            ("AWS_EC2_METADATA_DISABLED", "false"),
            ("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.trim_end_matches("/creds")),
            ("http_proxy", &proxy_url),
            ("ALL_PROXY", &proxy_url),
        ])
        .unwrap();
        assert!(c.credentials.is_none());
        assert!(served.join().unwrap().starts_with("PUT /latest/api/token HTTP/1.1\r\n"));
        assert!(proxy.accept().is_err(), "the proxy was asked");
        // While the store itself is reached through it.
        assert!(c.proxies.for_host("s3.us-east-1.amazonaws.com", 443, true).is_some());
    }
}
