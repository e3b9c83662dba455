//! Fuzzes the safetensors header parser with whole files: it must return
//! an error or a header that keeps every invariant, never panic, hang or
//! allocate far more than its input.
#![no_main]

use dmaload::format::safetensors::{parse, MAX_RANK};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(header) = parse(data, data.len() as u64) else { return };
    assert_eq!(header.file_len(), data.len() as u64);
    let mut expected = 0;
    for t in &header.tensors {
        assert!(t.shape.len() <= MAX_RANK);
        assert_eq!(t.data_offsets.0, expected, "tensors tile the data section");
        let bits = t.elements() as u128 * t.dtype.bits() as u128;
        assert_eq!(bits, t.byte_len() as u128 * 8);
        expected = t.data_offsets.1;
    }
    let mut names: Vec<_> = header.tensors.iter().map(|t| &t.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), header.tensors.len(), "names are unique");
});
