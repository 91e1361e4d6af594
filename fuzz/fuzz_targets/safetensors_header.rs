//! The safetensors reader (header length, JSON header, `__metadata__`,
//! dtypes, shapes, offsets) on arbitrary bytes.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use tandem_core::model::safetensors::SafetensorsFile;
use tandem_core::model::Bytes;

fuzz_target!(|data: &[u8]| {
    let bytes = Arc::new(Bytes::Owned(data.to_vec()));
    let _ = SafetensorsFile::parse(bytes, Path::new("fuzz.safetensors"));
});
