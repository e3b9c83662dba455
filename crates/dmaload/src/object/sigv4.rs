//! AWS Signature Version 4 for S3 requests without a body (GET, HEAD) or
//! with one whose hash is given: the canonical request, the string to sign
//! and the derived key, as AWS documents them. HMAC-SHA256 comes from the
//! `hmac` and `sha2` crates.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The keys requests are signed with, and where they came from (for
/// messages). `Debug` never shows the secret.
#[derive(Clone)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
    /// The source of the keys as a message names it (`AWS_ACCESS_KEY_ID`,
    /// `the keys of profile dev`, `web identity (role ARN)`...): never a
    /// secret.
    pub source: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// The SHA-256 of an empty payload, hex.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// Percent-encodes `s` as SigV4's canonical URI wants it: every byte but
/// the unreserved ones (and `/` when `keep_slash`).
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => out.push(b as char),
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The time of a signature: `YYYYMMDDTHHMMSSZ` and its date.
#[derive(Debug, Clone)]
pub struct Stamp {
    pub datetime: String,
}

impl Stamp {
    /// The stamp of `secs` since the Unix epoch (UTC).
    pub fn at(secs: u64) -> Stamp {
        let (year, month, day) = civil_from_days((secs / 86_400) as i64);
        let rem = secs % 86_400;
        Stamp {
            datetime: format!(
                "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
                rem / 3600,
                rem % 3600 / 60,
                rem % 60
            ),
        }
    }

    pub fn now() -> Stamp {
        let secs =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Stamp::at(secs)
    }

    fn date(&self) -> &str {
        &self.datetime[..8]
    }
}

/// The civil date (year, month, day) of a day number since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// The day number since 1970-01-01 of a civil date: the inverse of
/// [`civil_from_days`] (Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the Unix epoch of an RFC 3339 time,
/// `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`, as credential sources give
/// their keys' `Expiration`; `None` for anything else.
pub fn rfc3339_seconds(time: &str) -> Option<i64> {
    let num = |s: &str| s.parse::<i64>().ok().filter(|_| s.bytes().all(|b| b.is_ascii_digit()));
    let (date, rest) = time.split_once(['T', 't', ' '])?;
    let mut ymd = date.splitn(3, '-').map(num);
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let (clock, offset) = match rest.strip_suffix(['Z', 'z']) {
        Some(clock) => (clock, 0),
        None => {
            let at = rest.rfind(['+', '-'])?;
            let (h, mi) = rest[at + 1..].split_once(':')?;
            let sign = if rest.as_bytes()[at] == b'-' { -1 } else { 1 };
            (&rest[..at], sign * (num(h)? * 3600 + num(mi)? * 60))
        }
    };
    let clock = clock.split_once('.').map_or(clock, |(whole, _)| whole);
    let mut hms = clock.splitn(3, ':').map(num);
    let (h, mi, s) = (hms.next()??, hms.next()??, hms.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    Some(days_from_civil(y, m, d) * 86400 + h * 3600 + mi * 60 + s - offset)
}

/// One request to sign: `headers` are the ones sent besides those this
/// adds (`host` among them), names in lower case.
pub struct Request<'a> {
    pub method: &'a str,
    /// The canonical (already encoded) path.
    pub path: &'a str,
    /// The canonical query string ("" for none).
    pub query: &'a str,
    pub headers: &'a [(&'a str, String)],
    /// The payload's SHA-256, hex, or `UNSIGNED-PAYLOAD`.
    pub payload_sha256: &'a str,
}

/// The headers that sign `request` for S3 in `region` at `stamp`:
/// `x-amz-date`, `x-amz-content-sha256`, `x-amz-security-token` with a
/// session token, and `authorization`.
pub fn sign(
    request: &Request<'_>,
    credentials: &Credentials,
    region: &str,
    stamp: &Stamp,
) -> Vec<(&'static str, String)> {
    let mut added = vec![
        ("x-amz-content-sha256", request.payload_sha256.to_owned()),
        ("x-amz-date", stamp.datetime.clone()),
    ];
    if let Some(token) = &credentials.session_token {
        added.push(("x-amz-security-token", token.clone()));
    }
    let mut headers: Vec<(String, String)> = request
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .chain(added.iter().map(|(k, v)| (k.to_string(), v.clone())))
        .collect();
    headers.sort();
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{signed}\n{}",
        request.method, request.path, request.query, request.payload_sha256
    );
    let (scope, signature) = signature(&canonical, credentials, region, stamp);
    added.push((
        "authorization",
        format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
            credentials.access_key
        ),
    ));
    added
}

/// The scope and signature of a canonical request.
fn signature(canonical: &str, credentials: &Credentials, region: &str, stamp: &Stamp) -> (String, String) {
    let scope = format!("{}/{region}/s3/aws4_request", stamp.date());
    let to_sign =
        format!("AWS4-HMAC-SHA256\n{}\n{scope}\n{}", stamp.datetime, sha256_hex(canonical.as_bytes()));
    let key = hmac(format!("AWS4{}", credentials.secret_key).as_bytes(), stamp.date().as_bytes());
    let key = hmac(&key, region.as_bytes());
    let key = hmac(&key, b"s3");
    let key = hmac(&key, b"aws4_request");
    (scope, hex(&hmac(&key, to_sign.as_bytes())))
}

/// The query string that authorizes one `method` request for `path` on
/// `host` from `stamp` for `expires_secs` (a presigned URL's, query
/// authentication in AWS's words): only `host` is signed, so the request
/// may add a `Range` and an `If-Match`. Whoever holds the query may make
/// that request, and only that one, until it expires; the secret key
/// stays here.
pub fn presign(
    method: &str,
    host: &str,
    path: &str,
    credentials: &Credentials,
    region: &str,
    stamp: &Stamp,
    expires_secs: u64,
) -> String {
    let scope = format!("{}/{region}/s3/aws4_request", stamp.date());
    let mut params = vec![
        ("X-Amz-Algorithm", "AWS4-HMAC-SHA256".to_owned()),
        ("X-Amz-Credential", format!("{}/{scope}", credentials.access_key)),
        ("X-Amz-Date", stamp.datetime.clone()),
        ("X-Amz-Expires", expires_secs.to_string()),
        ("X-Amz-SignedHeaders", "host".to_owned()),
    ];
    if let Some(token) = &credentials.session_token {
        params.push(("X-Amz-Security-Token", token.clone()));
    }
    params.sort();
    let query: Vec<String> =
        params.iter().map(|(k, v)| format!("{}={}", uri_encode(k, false), uri_encode(v, false))).collect();
    let query = query.join("&");
    let canonical = format!("{method}\n{path}\n{query}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD");
    let (_, signature) = signature(&canonical, credentials, region, stamp);
    format!("{query}&X-Amz-Signature={signature}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's documented example: "GET Object" with a range, from the S3
    /// API reference's Signature Version 4 examples.
    #[test]
    fn signs_the_documented_get_object_example() {
        let credentials = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
            source: "AWS's example".into(),
        };
        let headers =
            [("host", "examplebucket.s3.amazonaws.com".to_owned()), ("range", "bytes=0-9".to_owned())];
        let request = Request {
            method: "GET",
            path: "/test.txt",
            query: "",
            headers: &headers,
            payload_sha256: EMPTY_SHA256,
        };
        let stamp = Stamp { datetime: "20130524T000000Z".into() };
        let signed = sign(&request, &credentials, "us-east-1", &stamp);
        let auth = &signed.iter().find(|(k, _)| *k == "authorization").unwrap().1;
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
    }

    /// AWS's documented example of query authentication: a GET of
    /// `test.txt` valid for 86400 s.
    #[test]
    fn presigns_the_documented_example() {
        let credentials = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
            source: "AWS's example".into(),
        };
        let stamp = Stamp { datetime: "20130524T000000Z".into() };
        let query = presign(
            "GET",
            "examplebucket.s3.amazonaws.com",
            "/test.txt",
            &credentials,
            "us-east-1",
            &stamp,
            86400,
        );
        assert_eq!(
            query,
            "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2F\
             aws4_request&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host&\
             X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
        );
    }

    #[test]
    fn stamps_and_encodings() {
        assert_eq!(Stamp::at(1_369_353_600).datetime, "20130524T000000Z");
        assert_eq!(Stamp::at(951_825_599).datetime, "20000229T115959Z");
        assert_eq!(uri_encode("a b/c+d~é", true), "a%20b/c%2Bd~%C3%A9");
        assert_eq!(uri_encode("a/b", false), "a%2Fb");
    }

    #[test]
    fn rfc3339_times_read_as_unix_seconds_and_back() {
        assert_eq!(rfc3339_seconds("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(rfc3339_seconds("2022-05-26T12:34:56.789Z"), Some(1_653_568_496));
        assert_eq!(rfc3339_seconds("2022-05-26T14:34:56+02:00"), Some(1_653_568_496));
        assert_eq!(rfc3339_seconds("2000-03-01T00:00:00Z"), Some(951_868_800));
        assert_eq!(rfc3339_seconds("2022-13-26T12:34:56Z"), None);
        assert_eq!(rfc3339_seconds("tomorrow"), None);
        // One calendar both ways: a stamp's time parses back to itself.
        for secs in [0u64, 951_825_599, 1_369_353_600, 4_102_444_799] {
            let d = Stamp::at(secs).datetime;
            let rfc =
                format!("{}-{}-{}T{}:{}:{}Z", &d[..4], &d[4..6], &d[6..8], &d[9..11], &d[11..13], &d[13..15]);
            assert_eq!(rfc3339_seconds(&rfc), Some(secs as i64), "{rfc}");
        }
    }
}
