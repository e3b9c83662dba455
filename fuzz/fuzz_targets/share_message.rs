//! Fuzzes the `share` protocol's decoding of untrusted messages: a request
//! as the cache service receives it, a reply as a client receives it, and
//! a reply's error turned back into a `dmaload::Error`. Each must return
//! a value or an error, never panic, hang or allocate far more than its
//! input.
#![no_main]

use dmaload::share::protocol::{decode, decode_request, Reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_request(data);
    if let Ok(Reply::Error(err)) = decode::<Reply>(data) {
        let err = err.into_error(None);
        let _ = (err.to_string(), err.errno());
    }
});
