//! Metadata values: scalars, strings, and arrays stored by element type.
//!
//! An array keeps its elements compact (`Vec<u8>` for a `u8` array, one text
//! buffer for a string array), so its memory is at most the bytes it takes
//! in the file: a hostile file cannot turn each byte of an array into a
//! 32-byte value.

use std::fmt;

/// One metadata value. The variant order follows GGUF's value type ids.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// An array's elements, all of one type (so a writer cannot mix them).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(StringArray),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

/// The strings of an array in one buffer: string `i` is `text[ends[i - 1]..ends[i]]`.
#[derive(Clone, Default, PartialEq)]
pub struct StringArray {
    text: String,
    ends: Vec<usize>,
}

/// GGUF's type id of arrays, as a value and as an element of an array of arrays.
pub(super) const ARRAY_TYPE_ID: u32 = 9;

impl GgufValue {
    /// GGUF's id for this value's type.
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => ARRAY_TYPE_ID,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    pub fn type_name(&self) -> &'static str {
        value_type_name(self.type_id())
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type holding a non-negative value that fits a `usize`.
    pub fn as_usize(&self) -> Option<usize> {
        let wide: i128 = match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        };
        usize::try_from(wide).ok()
    }

    /// An `f32` or `f64` value (the latter rounded).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// Bytes this value holds on the heap (string text, array elements).
    pub fn heap_bytes(&self) -> usize {
        match self {
            GgufValue::String(s) => s.capacity(),
            GgufValue::Array(items) => items.heap_bytes(),
            _ => 0,
        }
    }

    /// The value for a message: scalars as `Debug` shows them, arrays and
    /// long strings by their size, so a hostile value cannot flood an error.
    pub fn brief(&self) -> String {
        const SHOWN_CHARS: usize = 64;
        match self {
            GgufValue::Array(items) => format!(
                "an array of {} {} values",
                items.len(),
                items.element_type_name()
            ),
            GgufValue::String(s) if s.chars().nth(SHOWN_CHARS).is_some() => {
                format!("a string of {} bytes", s.len())
            }
            other => format!("{other:?}"),
        }
    }
}

impl GgufArray {
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// GGUF's type id of the elements.
    pub fn element_type_id(&self) -> u32 {
        match self {
            GgufArray::U8(_) => 0,
            GgufArray::I8(_) => 1,
            GgufArray::U16(_) => 2,
            GgufArray::I16(_) => 3,
            GgufArray::U32(_) => 4,
            GgufArray::I32(_) => 5,
            GgufArray::F32(_) => 6,
            GgufArray::Bool(_) => 7,
            GgufArray::String(_) => 8,
            GgufArray::Array(_) => ARRAY_TYPE_ID,
            GgufArray::U64(_) => 10,
            GgufArray::I64(_) => 11,
            GgufArray::F64(_) => 12,
        }
    }

    pub fn element_type_name(&self) -> &'static str {
        value_type_name(self.element_type_id())
    }

    pub fn as_strings(&self) -> Option<&StringArray> {
        match self {
            GgufArray::String(strings) => Some(strings),
            _ => None,
        }
    }

    /// Every element as a `usize`: an array of integers, all non-negative.
    pub fn to_usizes(&self) -> Option<Vec<usize>> {
        fn convert<T: Copy>(items: &[T]) -> Option<Vec<usize>>
        where
            usize: TryFrom<T>,
        {
            items.iter().map(|&v| usize::try_from(v).ok()).collect()
        }
        match self {
            GgufArray::U8(v) => convert(v),
            GgufArray::I8(v) => convert(v),
            GgufArray::U16(v) => convert(v),
            GgufArray::I16(v) => convert(v),
            GgufArray::U32(v) => convert(v),
            GgufArray::I32(v) => convert(v),
            GgufArray::U64(v) => convert(v),
            GgufArray::I64(v) => convert(v),
            _ => None,
        }
    }

    /// Every element as an `f32`: an array of `f32` or `f64` (rounded).
    pub fn to_f32s(&self) -> Option<Vec<f32>> {
        match self {
            GgufArray::F32(v) => Some(v.clone()),
            GgufArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }

    /// Element `i` as a value (a copy).
    pub fn get(&self, i: usize) -> Option<GgufValue> {
        Some(match self {
            GgufArray::U8(v) => GgufValue::U8(*v.get(i)?),
            GgufArray::I8(v) => GgufValue::I8(*v.get(i)?),
            GgufArray::U16(v) => GgufValue::U16(*v.get(i)?),
            GgufArray::I16(v) => GgufValue::I16(*v.get(i)?),
            GgufArray::U32(v) => GgufValue::U32(*v.get(i)?),
            GgufArray::I32(v) => GgufValue::I32(*v.get(i)?),
            GgufArray::F32(v) => GgufValue::F32(*v.get(i)?),
            GgufArray::Bool(v) => GgufValue::Bool(*v.get(i)?),
            GgufArray::String(v) => GgufValue::String(v.get(i)?.to_string()),
            GgufArray::Array(v) => GgufValue::Array(v.get(i)?.clone()),
            GgufArray::U64(v) => GgufValue::U64(*v.get(i)?),
            GgufArray::I64(v) => GgufValue::I64(*v.get(i)?),
            GgufArray::F64(v) => GgufValue::F64(*v.get(i)?),
        })
    }

    /// Bytes the elements take on the heap, by capacity.
    pub fn heap_bytes(&self) -> usize {
        fn bytes<T>(items: &Vec<T>) -> usize {
            items.capacity() * size_of::<T>()
        }
        match self {
            GgufArray::U8(v) => bytes(v),
            GgufArray::I8(v) => bytes(v),
            GgufArray::U16(v) => bytes(v),
            GgufArray::I16(v) => bytes(v),
            GgufArray::U32(v) => bytes(v),
            GgufArray::I32(v) => bytes(v),
            GgufArray::F32(v) => bytes(v),
            GgufArray::Bool(v) => bytes(v),
            GgufArray::String(v) => v.heap_bytes(),
            GgufArray::Array(v) => bytes(v) + v.iter().map(GgufArray::heap_bytes).sum::<usize>(),
            GgufArray::U64(v) => bytes(v),
            GgufArray::I64(v) => bytes(v),
            GgufArray::F64(v) => bytes(v),
        }
    }
}

impl StringArray {
    /// The array whose strings end at `ends` in `text`; the reader checks
    /// that the ends are non-decreasing, within `text` and on character boundaries.
    pub(super) fn from_parts(text: String, ends: Vec<usize>) -> Self {
        StringArray { text, ends }
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = i.checked_sub(1).map_or(0, |prev| self.ends[prev]);
        self.text.get(start..end)
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }

    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    pub fn heap_bytes(&self) -> usize {
        self.text.capacity() + self.ends.capacity() * size_of::<usize>()
    }
}

impl fmt::Debug for StringArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for StringArray {
    fn from_iter<I: IntoIterator<Item = S>>(items: I) -> Self {
        let mut strings = StringArray::default();
        for s in items {
            strings.push(s.as_ref());
        }
        strings
    }
}

fn value_type_name(type_id: u32) -> &'static str {
    match type_id {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "string",
        9 => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}
