//! The keys of AWS's default chain past the environment's keys: a web
//! identity token exchanged at STS (EKS IRSA and other OIDC federations),
//! a profile's `credential_process`, the container credentials of ECS and
//! EKS Pod Identity, and the EC2 instance metadata service (IMDSv2). Each
//! answers AWS's JSON (STS its XML); messages name the source, never a
//! secret or a token. The link-local services (container, instance) are
//! asked directly, never through a proxy, as AWS's SDKs ask them.

use std::io::{self, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use super::{Credentials, Endpoint};
use crate::object::http::{Connection, HandshakeRefused, Waiter, MAX_ERROR_BODY};
use crate::object::proxy::Proxy;
use crate::object::sigv4::{rfc3339_seconds, uri_encode};
use crate::object::tls::Tls;
use crate::object::xml;

/// How long a `credential_process` may run.
const PROCESS_TIME: Duration = Duration::from_secs(60);
/// The most a `credential_process` may print on stdout.
const PROCESS_OUTPUT: u64 = 1 << 20;
/// What of its stderr a failed process's message shows.
const PROCESS_STDERR: u64 = 4 << 10;
/// Time to connect to the instance metadata service and get its first
/// answer: short, so that a machine that is no EC2 instance is not slowed.
const IMDS_CONNECT: Duration = Duration::from_secs(1);
/// Time to connect to a credentials endpoint, and without a byte from it,
/// before it is given up.
const ENDPOINT_STALL: Duration = Duration::from_secs(5);
/// Time to connect to STS, and without a byte from it, before it is given up.
const STS_STALL: Duration = Duration::from_secs(10);
/// Tries at STS when it fails in a way its documentation calls transient
/// (a 5xx, `IDPCommunicationError`, no connection or answer), with waits of
/// [`STS_BACKOFF`], then twice that, between them.
const STS_ATTEMPTS: u32 = 3;
const STS_BACKOFF: Duration = Duration::from_millis(200);

/// A role to assume with a web identity token: `AWS_WEB_IDENTITY_TOKEN_FILE`,
/// `AWS_ROLE_ARN` and `AWS_ROLE_SESSION_NAME`, each else the profile's
/// `web_identity_token_file`, `role_arn`, `role_session_name`.
pub struct WebIdentity {
    token_file: String,
    role_arn: String,
    session_name: String,
    /// Where the settings came from, for messages.
    source: String,
}

impl WebIdentity {
    /// The settings, when a token file is named (`None` otherwise: a
    /// profile's `role_arn` alone is no web identity); an error when the
    /// role is missing.
    pub fn find(
        env: &dyn Fn(&str) -> Option<String>,
        profile_setting: &dyn Fn(&str) -> Option<String>,
        profile: &str,
    ) -> Result<Option<WebIdentity>, String> {
        let (token_file, source) = match env("AWS_WEB_IDENTITY_TOKEN_FILE") {
            Some(file) => (file, "AWS_WEB_IDENTITY_TOKEN_FILE".to_owned()),
            None => match profile_setting("web_identity_token_file") {
                Some(file) => (file, format!("web_identity_token_file of profile {profile}")),
                None => return Ok(None),
            },
        };
        let role_arn = env("AWS_ROLE_ARN").or_else(|| profile_setting("role_arn")).ok_or_else(|| {
            format!("web identity ({source}={token_file}): no role to assume (set AWS_ROLE_ARN or role_arn)")
        })?;
        let session_name = env("AWS_ROLE_SESSION_NAME")
            .or_else(|| profile_setting("role_session_name"))
            .unwrap_or_else(|| format!("dmaload-{}", unix_now()));
        Ok(Some(WebIdentity { token_file, role_arn, session_name, source }))
    }

    /// `why` as this source's failure: it names the token's file and the
    /// role, never the token.
    pub fn failed(&self, why: &str) -> String {
        format!("web identity ({}={}, role {}): {why}", self.source, self.token_file, self.role_arn)
    }

    /// The role's keys from STS's `AssumeRoleWithWebIdentity` at `sts`: an
    /// unsigned form POST (the token is the authority), over `tls` and
    /// through `proxy` when given.
    pub fn assume_role(
        &self,
        sts: &Endpoint,
        tls: Option<&Tls>,
        proxy: Option<&Proxy>,
    ) -> Result<Credentials, String> {
        let token =
            read_token(&self.token_file).map_err(|e| self.failed(&format!("{}: {e}", self.token_file)))?;
        let form: Vec<String> = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", "2011-06-15"),
            ("RoleArn", &self.role_arn),
            ("RoleSessionName", &self.session_name),
            ("WebIdentityToken", &token),
        ]
        .iter()
        .map(|(k, v)| format!("{k}={}", uri_encode(v, false)))
        .collect();
        let headers = [("Content-Type", "application/x-www-form-urlencoded"), ("Accept", "text/xml")];
        let path = if sts.prefix.is_empty() { "/" } else { &sts.prefix };
        let op = format!("AssumeRoleWithWebIdentity at {}", sts.url());
        let form = form.join("&");
        let mut attempt = 1;
        let body = loop {
            // What failed, and whether STS's documentation calls it worth another try.
            let (why, again) =
                match request(sts, "POST", path, &headers, form.as_bytes(), tls, proxy, STS_STALL) {
                    Ok((200, body)) => break String::from_utf8_lossy(&body).into_owned(),
                    Ok((status, body)) => {
                        // STS's error: <ErrorResponse><Error><Code>...</Code><Message>...
                        let body = String::from_utf8_lossy(&body);
                        let code = xml::field(&body, "Code");
                        // (An identity provider's message that echoes the token does not show it.)
                        let message = xml::field(&body, "Message")
                            .map_or(String::new(), |m| format!(": {}", m.replace(&token, "<the token>")));
                        let again = status >= 500 || code.as_deref() == Some("IDPCommunicationError");
                        (
                            format!(
                                "HTTP {status}{}{message}",
                                code.map_or(String::new(), |c| format!(" {c}"))
                            ),
                            again,
                        )
                    }
                    // A proxy's refusal, a certificate that does not verify: the same again.
                    Err(e) => (e.to_string(), !HandshakeRefused::is(&e)),
                };
            if !again {
                return Err(self.failed(&format!("{op}: {why}")));
            }
            if attempt == STS_ATTEMPTS {
                return Err(self.failed(&format!("{op}: {why} ({attempt} attempts)")));
            }
            std::thread::sleep(STS_BACKOFF * attempt);
            attempt += 1;
        };
        let credentials = xml::field(&body, "Credentials").unwrap_or_default();
        let need = |name: &str| {
            xml::field(&credentials, name)
                .ok_or_else(|| self.failed(&format!("{op}: its answer names no Credentials/{name}")))
        };
        let keys = Credentials {
            access_key: need("AccessKeyId")?,
            secret_key: need("SecretAccessKey")?,
            session_token: Some(need("SessionToken")?),
            source: format!("web identity ({}, role {})", self.source, self.role_arn),
        };
        unexpired(xml::field(&credentials, "Expiration").as_deref())
            .map_err(|e| self.failed(&format!("{op}: {e}")))?;
        Ok(keys)
    }
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// Runs `command` (a profile's `credential_process`) as AWS's tools do:
/// split at spaces, `"..."` keeping spaces in one word, run without a
/// shell; its stdout is JSON with `Version` 1.
pub fn from_process(profile: &str, command: &str) -> Result<Credentials, String> {
    from_process_within(profile, command, PROCESS_TIME)
}

/// [`from_process`] with `limit` for [`PROCESS_TIME`].
fn from_process_within(profile: &str, command: &str, limit: Duration) -> Result<Credentials, String> {
    let words = split_command(command);
    let Some(program) = words.first() else {
        return Err(format!("credential_process of profile {profile} is empty"));
    };
    let fail = |why: String| format!("credential_process of profile {profile} ({program}): {why}");
    let mut child = Command::new(program)
        .args(&words[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run it: {e}")))?;
    // Readers on threads, so a full pipe never stalls the process; each
    // takes a bounded amount, then closes its end and hands it over.
    let read = |pipe: Option<Box<dyn Read + Send>>, limit: u64| {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(pipe) = pipe {
                let _ = pipe.take(limit).read_to_end(&mut bytes);
            }
            let _ = sender.send(bytes);
        });
        receiver
    };
    let stdout = read(child.stdout.take().map(|p| Box::new(p) as _), PROCESS_OUTPUT + 1);
    let stderr = read(child.stderr.take().map(|p| Box::new(p) as _), PROCESS_STDERR);
    // Done when it has exited and its stdout is closed: a child it left
    // behind may hold stdout open, and is waited for within the limit too.
    let started = Instant::now();
    let (mut status, mut output) = (None, None);
    let (status, output) = loop {
        if status.is_none() {
            status = child.try_wait().map_err(|e| fail(format!("cannot wait for it: {e}")))?;
        }
        if output.is_none() {
            output = stdout.try_recv().ok();
        }
        match (status, output) {
            (Some(status), Some(output)) => break (status, output),
            (exited, printed) => {
                let too_much = printed.as_ref().is_some_and(|o: &Vec<u8>| o.len() as u64 > PROCESS_OUTPUT);
                if too_much || started.elapsed() >= limit {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(fail(match too_much {
                        true => format!("printed more than {PROCESS_OUTPUT} bytes"),
                        false => format!(
                            "not done (exited, its output closed) after {} s; killed",
                            limit.as_secs_f64()
                        ),
                    }));
                }
                (status, output) = (exited, printed);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    // (Its stdout closed at the limit may have ended it first.)
    if output.len() as u64 > PROCESS_OUTPUT {
        return Err(fail(format!("printed more than {PROCESS_OUTPUT} bytes")));
    }
    if !status.success() {
        let said = stderr.recv_timeout(Duration::from_millis(100)).unwrap_or_default();
        return Err(fail(format!("{status}: {}", String::from_utf8_lossy(&said).trim())));
    }
    let json = parse_json(&output).map_err(&fail)?;
    if json.get("Version").and_then(|v| v.as_u64()) != Some(1) {
        return Err(fail("its JSON has no \"Version\": 1".to_owned()));
    }
    keys(&json, "SessionToken", format!("credential_process of profile {profile}")).map_err(fail)
}

/// The container credentials of ECS (`AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`
/// on 169.254.170.2) or of a `AWS_CONTAINER_CREDENTIALS_FULL_URI` (EKS Pod
/// Identity, a local agent), with `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`'s
/// contents or `AWS_CONTAINER_AUTHORIZATION_TOKEN` as the `Authorization`
/// header; `None` when neither URI is set.
pub fn from_container(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Credentials>, String> {
    let (url, setting) =
        match (env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"), env("AWS_CONTAINER_CREDENTIALS_FULL_URI")) {
            (Some(relative), _) => {
                (format!("http://169.254.170.2{relative}"), "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
            }
            (None, Some(full)) => (full, "AWS_CONTAINER_CREDENTIALS_FULL_URI"),
            (None, None) => return Ok(None),
        };
    let fail = |why: String| format!("container credentials ({setting}={url}): {why}");
    let endpoint = Endpoint::parse(&url).map_err(fail)?;
    // Over plain HTTP AWS's tools send the token only to the container
    // agents' addresses and this machine.
    let host = endpoint.host.trim_start_matches('[').trim_end_matches(']');
    let local = matches!(host, "localhost" | "169.254.170.2" | "169.254.170.23" | "fd00:ec2::23")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if endpoint.https || !local {
        return Err(fail(
            "only http:// to 169.254.170.2, 169.254.170.23, fd00:ec2::23 or this machine is supported"
                .to_owned(),
        ));
    }
    let token = match env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE") {
        Some(file) => Some(
            read_token(&file)
                .map_err(|e| fail(format!("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {file}: {e}")))?,
        ),
        None => env("AWS_CONTAINER_AUTHORIZATION_TOKEN"),
    };
    let headers: Vec<(&str, &str)> = token.iter().map(|t| ("Authorization", t.as_str())).collect();
    let path = if endpoint.prefix.is_empty() { "/" } else { &endpoint.prefix };
    let (status, body) =
        direct(&endpoint, "GET", path, &headers, ENDPOINT_STALL).map_err(|e| fail(e.to_string()))?;
    if status != 200 {
        return Err(fail(format!("HTTP {status}")));
    }
    let json = parse_json(&body).map_err(&fail)?;
    keys(&json, "Token", format!("container credentials ({setting})")).map(Some).map_err(fail)
}

/// The keys of the EC2 instance's role from its metadata service (IMDSv2:
/// a session token first, then the role's name, then its keys), unless
/// `AWS_EC2_METADATA_DISABLED` is true. `None` when no service gives a
/// token within [`IMDS_CONNECT`] (no EC2 instance) or the instance has no
/// role. `AWS_EC2_METADATA_SERVICE_ENDPOINT` names another endpoint.
pub fn from_imds(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Credentials>, String> {
    if env("AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let url = env("AWS_EC2_METADATA_SERVICE_ENDPOINT").unwrap_or_else(|| "http://169.254.169.254".to_owned());
    let fail = |why: String| format!("instance metadata service {url}: {why}");
    let endpoint = Endpoint::parse(&url).map_err(fail)?;
    if endpoint.https {
        return Err(fail("only http:// is supported".to_owned()));
    }
    let at = |path: &str| format!("{}{path}", endpoint.prefix);
    let ttl = [("X-aws-ec2-metadata-token-ttl-seconds", "21600")];
    let token = match direct(&endpoint, "PUT", &at("/latest/api/token"), &ttl, IMDS_CONNECT) {
        Ok((200, token)) => String::from_utf8(token).map_err(|_| fail("its token is not text".to_owned()))?,
        // One attempt: nothing there, nothing that answers HTTP, or another
        // cloud's metadata service (GCP's and Azure's answer at this address).
        Ok(_) | Err(_) => return Ok(None),
    };
    let header = [("X-aws-ec2-metadata-token", token.trim())];
    let roles = at("/latest/meta-data/iam/security-credentials/");
    let get = |path: &str| {
        direct(&endpoint, "GET", path, &header, ENDPOINT_STALL).map_err(|e| fail(format!("GET {path}: {e}")))
    };
    let role = match get(&roles)? {
        (200, body) => String::from_utf8_lossy(&body).lines().next().unwrap_or("").trim().to_owned(),
        (404, _) => return Ok(None),
        (status, _) => return Err(fail(format!("GET {roles}: HTTP {status}"))),
    };
    if role.is_empty() {
        return Ok(None);
    }
    let path = format!("{roles}{role}");
    let body = match get(&path)? {
        (200, body) => body,
        (status, _) => return Err(fail(format!("GET {path}: HTTP {status}"))),
    };
    let json = parse_json(&body).map_err(&fail)?;
    match json.get("Code").and_then(|c| c.as_str()) {
        None | Some("Success") => {
            let source = format!("the instance metadata service (role {role})");
            keys(&json, "Token", source).map(Some).map_err(fail)
        }
        Some(code) => Err(fail(format!("the role {role}'s keys: Code {code}"))),
    }
}

/// The token in `file`, without its line end: a regular file of at most
/// [`MAX_ERROR_BODY`] bytes (opened without blocking, so a FIFO there is
/// refused rather than waited on).
fn read_token(file: &str) -> io::Result<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(file)?;
    if !opened.metadata()?.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
    }
    let mut token = String::new();
    opened.take(MAX_ERROR_BODY as u64 + 1).read_to_string(&mut token)?;
    if token.len() > MAX_ERROR_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("longer than {MAX_ERROR_BODY} bytes"),
        ));
    }
    Ok(token.trim().to_owned())
}

/// Splits a command line as AWS's tools do: at spaces, with `"..."`
/// making one word of what it holds.
fn split_command(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let (mut word, mut quoted, mut started) = (String::new(), false, false);
    for c in command.chars() {
        match c {
            '"' => (quoted, started) = (!quoted, true),
            c if c.is_whitespace() && !quoted => {
                if started {
                    words.push(std::mem::take(&mut word));
                }
                started = false;
            }
            c => (word, started) = (word + c.encode_utf8(&mut [0; 4]), true),
        }
    }
    if started {
        words.push(word);
    }
    words
}

/// A JSON object; the message never shows the bytes (they may hold keys).
fn parse_json(bytes: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_slice(bytes) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err("its output is JSON but no object".to_owned()),
        Err(e) => Err(format!(
            "its output is no JSON object ({} at line {} column {})",
            kind(&e),
            e.line(),
            e.column()
        )),
    }
}

fn kind(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Eof => "it ends early",
        serde_json::error::Category::Syntax => "a syntax error",
        _ => "unreadable",
    }
}

/// `AccessKeyId`, `SecretAccessKey` and the session token (`token` names
/// its field) of AWS's JSON, from `source`; keys whose `Expiration` has
/// passed are refused.
fn keys(
    json: &serde_json::Map<String, serde_json::Value>,
    token: &str,
    source: String,
) -> Result<Credentials, String> {
    let field = |name: &str| match json.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("its JSON's {name:?} is not a string")),
    };
    let need = |name: &str| field(name)?.ok_or_else(|| format!("its JSON names no {name:?}"));
    let credentials = Credentials {
        access_key: need("AccessKeyId")?,
        secret_key: need("SecretAccessKey")?,
        session_token: field(token)?,
        source,
    };
    unexpired(field("Expiration")?.as_deref())?;
    Ok(credentials)
}

/// Refuses keys whose `Expiration` (RFC 3339) has passed or is no time.
fn unexpired(expiration: Option<&str>) -> Result<(), String> {
    let Some(expiration) = expiration else { return Ok(()) };
    let at = rfc3339_seconds(expiration)
        .ok_or_else(|| format!("its \"Expiration\" {expiration:?} is no RFC 3339 time"))?;
    if at <= unix_now() {
        return Err(format!("its keys expired at {expiration}"));
    }
    Ok(())
}

/// [`request`] over plain HTTP, never through a proxy: for the link-local
/// credential services.
fn direct(
    endpoint: &Endpoint,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    wait: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    request(endpoint, method, path, headers, b"", None, None, wait)
}

/// One request on a fresh connection (closed after it), over `tls` and
/// through `proxy` when given: its status and body, which must be at most
/// [`MAX_ERROR_BODY`] bytes. `wait` bounds the connect, and each wait for
/// a byte.
#[allow(clippy::too_many_arguments)]
fn request(
    endpoint: &Endpoint,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    tls: Option<&Tls>,
    proxy: Option<&Proxy>,
    wait: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
    if path.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err(invalid(format!("{path:?} is no request path")));
    }
    let waiter = Waiter { stopped: &|| false, stall: wait };
    let mut connection = Connection::open(&endpoint.host, endpoint.port, wait, tls, proxy, &waiter)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", endpoint.authority(&endpoint.host));
    for (name, value) in headers {
        if value.contains(['\r', '\n']) {
            return Err(invalid(format!("the {name} header holds a line break")));
        }
        head += &format!("{name}: {value}\r\n");
    }
    head += &format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    connection.send(&request)?;
    let response = connection.read_head(&waiter)?;
    if response.header("transfer-encoding").is_some_and(|v| !v.trim().eq_ignore_ascii_case("identity")) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a chunked response (expected a Content-Length)",
        ));
    }
    // Without a length the body ends where the server closes the connection.
    let len = match response.content_length() {
        Some(n) if n > MAX_ERROR_BODY as u64 => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("HTTP {}: a body of {n} bytes, more than {MAX_ERROR_BODY}", response.status),
            ))
        }
        Some(n) => n as usize,
        None => MAX_ERROR_BODY,
    };
    Ok((response.status, connection.read_body(len, &waiter)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_split_as_aws_tools_split_them() {
        assert_eq!(split_command(" /opt/bin/creds  --user helen "), ["/opt/bin/creds", "--user", "helen"]);
        assert_eq!(
            split_command(r#""/home/a b/creds" --name "x y" "" z"#),
            ["/home/a b/creds", "--name", "x y", "", "z"]
        );
        assert!(split_command("   ").is_empty());
    }

    #[test]
    fn aws_json_gives_keys_and_is_refused_when_wrong() {
        let json = |text: &str| parse_json(text.as_bytes());
        let ok = json(r#"{"Version":1,"AccessKeyId":"AK","SecretAccessKey":"SK","SessionToken":"T","Expiration":"2999-01-02T03:04:05Z"}"#).unwrap();
        let c = keys(&ok, "SessionToken", "p".into()).unwrap();
        assert_eq!(
            (c.access_key.as_str(), c.secret_key.as_str(), c.session_token.as_deref()),
            ("AK", "SK", Some("T"))
        );
        let container =
            json(r#"{"AccessKeyId":"AK","SecretAccessKey":"SK","Token":"T2","RoleArn":"r"}"#).unwrap();
        assert_eq!(keys(&container, "Token", "c".into()).unwrap().session_token.as_deref(), Some("T2"));
        let no_secret = keys(&json(r#"{"AccessKeyId":"AK"}"#).unwrap(), "Token", "c".into()).unwrap_err();
        assert!(no_secret.contains("SecretAccessKey"), "{no_secret}");
        let expired =
            json(r#"{"AccessKeyId":"AK","SecretAccessKey":"SK","Expiration":"2020-01-01T00:00:00Z"}"#)
                .unwrap();
        let why = keys(&expired, "Token", "c".into()).unwrap_err();
        assert!(why.contains("expired at 2020-01-01T00:00:00Z") && !why.contains("SK"), "{why}");
        let garbage = json("AccessKeyId=AK SecretAccessKey=SK").unwrap_err();
        assert!(garbage.contains("no JSON") && !garbage.contains("SK"), "{garbage}");
        assert!(json("[1]").is_err());
    }

    /// A process that hangs, or leaves a child holding its stdout, or
    /// prints without end, is stopped at its limit with a message saying so.
    #[test]
    fn a_process_that_hangs_or_floods_is_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{text}\n")).unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
            path.display().to_string()
        };
        let limit = Duration::from_millis(500);
        let hangs = script("hangs.sh", "exec sleep 30");
        let why = from_process_within("p", &hangs, limit).unwrap_err();
        assert!(why.contains("not done") && why.ends_with("killed"), "{why}");
        let leaves = script("leaves.sh", "sleep 5 &\necho '{}'");
        let why = from_process_within("p", &leaves, limit).unwrap_err();
        assert!(why.contains("not done (exited, its output closed) after 0.5 s"), "{why}");
        let floods = script("floods.sh", "exec yes");
        let why = from_process_within("p", &floods, Duration::from_secs(30)).unwrap_err();
        assert!(why.ends_with(&format!("printed more than {PROCESS_OUTPUT} bytes")), "{why}");
    }

    /// A token file that is a FIFO (or a directory) is refused at once,
    /// never waited on, before any request.
    #[test]
    fn a_token_file_that_is_no_regular_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("token");
        assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let fifo = fifo.display().to_string();
        let env = |name: &str| match name {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI" => Some("http://127.0.0.1:1/creds".to_owned()),
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE" => Some(fifo.clone()),
            _ => None,
        };
        let why = from_container(&env).unwrap_err();
        assert!(
            why.ends_with(&format!("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {fifo}: not a regular file")),
            "{why}"
        );
    }
}
