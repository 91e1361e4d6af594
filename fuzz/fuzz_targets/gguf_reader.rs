//! The GGUF reader, then the loader's configuration, tensor and tokenizer
//! checks, on arbitrary bytes: an error is fine, a panic, hang or huge
//! allocation is a finding.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use tandem_core::model::gguf::{model_from_gguf, GgufFile};
use tandem_core::model::Bytes;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(file) = GgufFile::parse(Arc::new(Bytes::Owned(data.to_vec())), path) else {
        return;
    };
    if let Ok(model) = model_from_gguf(file, path) {
        let _ = model.tokenizer.encode("Hello, world", true);
    }
});
