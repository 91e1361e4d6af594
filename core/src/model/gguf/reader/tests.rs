use super::super::testing::parse;
use super::super::GgufWriter;
use super::*;
use crate::model::gguf::testing::test_values;
use crate::quant::quantize_row;

/// The message of a parse failure, which must be a `BadModelFile` naming the file.
fn parse_error(bytes: Vec<u8>) -> String {
    match parse(bytes) {
        Err(e @ Error::BadModelFile { .. }) => {
            let message = e.to_string();
            assert!(message.starts_with("test.gguf: "), "{message}");
            message
        }
        Err(other) => panic!("expected a BadModelFile error, got {other}"),
        Ok(_) => panic!("parsed a bad file"),
    }
}

fn find(bytes: &[u8], needle: &str) -> usize {
    bytes
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
        .unwrap_or_else(|| panic!("{needle} not in the file"))
}

fn put_u32(bytes: &mut [u8], at: usize, value: u32) {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// Where the fields of the tensor info named `name` start: (n_dims, dims, type, offset).
fn tensor_info_fields(bytes: &[u8], name: &str) -> (usize, usize, usize, usize) {
    let n_dims_at = find(bytes, name) + name.len();
    let n_dims = u32::from_le_bytes(bytes[n_dims_at..n_dims_at + 4].try_into().unwrap());
    let type_at = n_dims_at + 4 + 8 * n_dims as usize;
    (n_dims_at, n_dims_at + 4, type_at, type_at + 4)
}

/// A small file: two metadata entries and two tensors, one quantized.
fn sample_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.name", GgufValue::String("sample".into()))
        .unwrap();
    w.add_metadata("test.array", GgufValue::Array(GgufArray::U32(vec![1, 2])))
        .unwrap();
    let a = quantize_row(WeightFormat::F32, &test_values(8));
    w.add_tensor("tensor_a", WeightFormat::F32, &[4, 2], a)
        .unwrap();
    let b = quantize_row(WeightFormat::Q8_0, &test_values(32));
    w.add_tensor("tensor_b", WeightFormat::Q8_0, &[32, 1], b)
        .unwrap();
    w.to_bytes()
}
#[test]
fn truncated_file_fails_cleanly_wherever_it_is_cut() {
    let bytes = sample_file();
    let last = parse(bytes.clone()).unwrap().tensors.pop().unwrap();
    // Past the last tensor's data there is only padding, which a reader need not see.
    for cut in 0..last.offset + last.len {
        let message = parse_error(bytes[..cut].to_vec());
        assert!(
            message.contains("truncated")
                || message.contains("past the end")
                || message.contains("not a GGUF file"),
            "cut at {cut}: {message}"
        );
    }
    let in_header = parse_error(bytes[..12].to_vec());
    assert!(
        in_header.contains("truncated: header runs past the end of the file (size 12 bytes)"),
        "{in_header}"
    );
    let in_metadata = parse_error(bytes[..find(&bytes, "test.array") + 20].to_vec());
    assert!(
        in_metadata.contains("truncated: metadata entry 2 of 2 ('test.array') runs past the end"),
        "{in_metadata}"
    );
    let in_infos = parse_error(bytes[..find(&bytes, "tensor_b") + 10].to_vec());
    assert!(
        in_infos.contains("truncated: tensor info 2 of 2 ('tensor_b') runs past the end"),
        "{in_infos}"
    );
    let in_data = parse_error(bytes[..last.offset + 10].to_vec());
    assert!(
        in_data.contains("tensor 'tensor_b'") && in_data.contains("past the end of the file"),
        "{in_data}"
    );
}

#[test]
fn wrong_magic_is_named() {
    let mut bytes = sample_file();
    bytes[..4].copy_from_slice(b"PK\x03\x04");
    let message = parse_error(bytes);
    assert!(
        message.contains(r"not a GGUF file (magic is 'PK\x03\x04')"),
        "{message}"
    );
}

#[test]
fn unsupported_versions_are_named() {
    let mut bytes = sample_file();
    put_u32(&mut bytes, 4, 1);
    let message = parse_error(bytes.clone());
    assert!(message.contains("unsupported GGUF version 1"), "{message}");
    put_u32(&mut bytes, 4, 3u32.swap_bytes());
    let message = parse_error(bytes.clone());
    assert!(message.contains("big-endian"), "{message}");
    put_u32(&mut bytes, 4, 2);
    assert_eq!(parse(bytes).unwrap().version, 2);
}

#[test]
fn tensor_past_the_end_is_named() {
    let mut bytes = sample_file();
    let (_, _, _, offset_at) = tensor_info_fields(&bytes, "tensor_a");
    for offset in [1 << 20, u64::MAX - 31] {
        put_u64(&mut bytes, offset_at, offset);
        let message = parse_error(bytes.clone());
        assert!(
            message.contains(&format!(
                "at data offset {offset}) runs past the end of the file"
            )),
            "{message}"
        );
    }
}

#[test]
fn misaligned_tensor_offset_is_named() {
    let mut bytes = sample_file();
    let (_, _, _, offset_at) = tensor_info_fields(&bytes, "tensor_b");
    let offset = u64::from_le_bytes(bytes[offset_at..offset_at + 8].try_into().unwrap());
    put_u64(&mut bytes, offset_at, offset + 4);
    let message = parse_error(bytes);
    assert!(
        message.contains("not a multiple of the alignment 32"),
        "{message}"
    );
}

#[test]
fn absurd_dimensions_are_named() {
    let mut bytes = sample_file();
    let (_, dims_at, _, _) = tensor_info_fields(&bytes, "tensor_a");
    put_u64(&mut bytes, dims_at, 1 << 40);
    put_u64(&mut bytes, dims_at + 8, 1 << 40);
    let message = parse_error(bytes);
    assert!(
        message.contains("tensor 'tensor_a' has absurd shape [1099511627776, 1099511627776]"),
        "{message}"
    );

    let mut bytes = sample_file();
    let (n_dims_at, _, _, _) = tensor_info_fields(&bytes, "tensor_a");
    put_u32(&mut bytes, n_dims_at, 7);
    let message = parse_error(bytes);
    assert!(message.contains("('tensor_a'): 7 dimensions"), "{message}");
}

#[test]
fn columns_must_be_whole_blocks() {
    let mut bytes = sample_file();
    let (_, dims_at, _, _) = tensor_info_fields(&bytes, "tensor_b");
    put_u64(&mut bytes, dims_at, 16);
    put_u64(&mut bytes, dims_at + 8, 2);
    let message = parse_error(bytes);
    assert!(
        message.contains("tensor 'tensor_b' (Q8_0) has 16 columns, not a multiple"),
        "{message}"
    );
}

#[test]
fn huge_string_and_array_lengths_fail_without_allocating() {
    let mut bytes = sample_file();
    let key_at = find(&bytes, "general.name");
    put_u64(&mut bytes, key_at - 8, 1 << 60);
    let message = parse_error(bytes);
    assert!(
        message
            .contains("metadata entry 1 of 2: string length 1152921504606846976 runs past the end"),
        "{message}"
    );

    let mut bytes = sample_file();
    let count_at = find(&bytes, "test.array") + "test.array".len() + 8;
    put_u64(&mut bytes, count_at, 1 << 60);
    let message = parse_error(bytes);
    assert!(
        message.contains("('test.array'): array length 1152921504606846976 runs past the end"),
        "{message}"
    );

    let mut bytes = sample_file();
    put_u64(&mut bytes, 8, u64::MAX);
    let message = parse_error(bytes);
    assert!(
        message.contains("tensor count 18446744073709551615"),
        "{message}"
    );
}

#[test]
fn unknown_tensor_types_are_named() {
    let mut bytes = sample_file();
    let (_, _, type_at, _) = tensor_info_fields(&bytes, "tensor_b");
    put_u32(&mut bytes, type_at, 99);
    let message = parse_error(bytes.clone());
    assert!(
        message.contains("tensor 'tensor_b' has unknown ggml type id 99"),
        "{message}"
    );
    put_u32(&mut bytes, type_at, 16);
    let message = parse(bytes).err().unwrap().to_string();
    assert!(
        message.contains("tensor 'tensor_b' is stored as IQ2_XXS (ggml type 16)"),
        "{message}"
    );
}

#[test]
fn bad_metadata_is_named() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.name", GgufValue::String("x".into()))
        .unwrap();
    let mut bytes = w.to_bytes();
    let type_at = find(&bytes, "general.name") + "general.name".len();
    put_u32(&mut bytes, type_at, 13);
    let message = parse_error(bytes.clone());
    assert!(message.contains("unknown value type 13"), "{message}");
    put_u32(&mut bytes, type_at, 8);
    let value_at = type_at + 4 + 8;
    bytes[value_at] = 0xff;
    let message = parse_error(bytes);
    assert!(message.contains("not valid UTF-8"), "{message}");

    let mut w = GgufWriter::new();
    w.add_metadata(ALIGNMENT_KEY, GgufValue::U32(64)).unwrap();
    let mut bytes = w.to_bytes();
    let value_at = find(&bytes, ALIGNMENT_KEY) + ALIGNMENT_KEY.len() + 4;
    put_u32(&mut bytes, value_at, 48);
    let message = parse_error(bytes);
    assert!(message.contains("must be a power of two"), "{message}");
}
