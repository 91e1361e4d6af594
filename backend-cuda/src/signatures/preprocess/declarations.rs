//! The kernels' entry points and parameter kinds, read from the tokens
//! the preprocessor leaves: kept apart from it because what a declaration
//! means (its C types, a struct's layout) is no concern of macro expansion.

use std::collections::{BTreeMap, HashMap};

use super::{preprocess, Tok, TokKind};
use crate::signatures::Kind;

/// A preprocessed translation unit's kernels and the types they name.
#[derive(Debug, Default)]
pub(crate) struct Unit {
    /// `extern "C" __global__` functions by name: their parameters' kinds
    /// (a struct's `bytes` as the kernels lay it out).
    pub kernels: BTreeMap<String, Vec<Kind>>,
    /// `__global__` functions without `extern "C"` (mangled: not loadable by name).
    pub mangled: Vec<String>,
}

/// The kernels of a translation unit.
pub(crate) fn kernels(source: &str) -> Result<Unit, String> {
    let tokens = preprocess(source)?;
    let types = Types::scan(&tokens)?;
    let mut unit = Unit::default();
    for (i, t) in tokens.iter().enumerate() {
        if !t.is("__global__") {
            continue;
        }
        let extern_c = i >= 2 && tokens[i - 2].is("extern") && tokens[i - 1].text == "\"C\"";
        let mut j = i + 1;
        let expect = |j: usize, what: &str| -> Result<&Tok, String> {
            tokens
                .get(j)
                .ok_or_else(|| format!("the unit ends inside a __global__ declaration ({what})"))
        };
        if !expect(j, "void")?.is("void") {
            return Err(format!(
                "a __global__ function returning {}",
                tokens[j].text
            ));
        }
        j += 1;
        if expect(j, "name")?.is("__launch_bounds__") {
            j = skip_parens(&tokens, j + 1)?;
        }
        let name = expect(j, "name")?;
        if name.kind != TokKind::Ident {
            return Err(format!("a __global__ function named {}", name.text));
        }
        let name = name.text.clone();
        if !expect(j + 1, "(")?.is("(") {
            return Err(format!("__global__ {name}: no parameter list"));
        }
        let end = skip_parens(&tokens, j + 1)?;
        let params = split_commas(&tokens[j + 2..end - 1]);
        let kinds = params
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| types.kind(p).map_err(|e| format!("kernel {name}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        if !extern_c {
            unit.mangled.push(name);
        } else if unit.kernels.insert(name.clone(), kinds).is_some() {
            return Err(format!("kernel {name} is declared twice"));
        }
    }
    Ok(unit)
}

/// The index after the parenthesised group that opens at `open`.
fn skip_parens(tokens: &[Tok], open: usize) -> Result<usize, String> {
    if !tokens.get(open).is_some_and(|t| t.is("(")) {
        return Err("expected (".into());
    }
    let mut depth = 0;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        if t.is("(") {
            depth += 1;
        } else if t.is(")") {
            depth -= 1;
            if depth == 0 {
                return Ok(i + 1);
            }
        }
    }
    Err("unbalanced parentheses".into())
}

fn split_commas(tokens: &[Tok]) -> Vec<Vec<&Tok>> {
    let mut out = vec![Vec::new()];
    let mut depth = 0;
    for t in tokens {
        if t.is("(") || t.is("<") || t.is("[") {
            depth += 1;
        } else if t.is(")") || t.is(">") || t.is("]") {
            depth -= 1;
        }
        if t.is(",") && depth == 0 {
            out.push(Vec::new());
        } else {
            out.last_mut().expect("one part at least").push(t);
        }
    }
    out
}

const QUALIFIERS: &[&str] = &["const", "volatile", "__restrict__", "__restrict", "struct"];

/// The unit's typedefs and structs.
struct Types {
    typedefs: HashMap<String, Vec<String>>,
    /// Struct fields in order, as type and name tokens.
    structs: HashMap<String, Vec<Vec<String>>>,
}

impl Types {
    fn scan(tokens: &[Tok]) -> Result<Self, String> {
        let mut types = Types {
            typedefs: HashMap::new(),
            structs: HashMap::new(),
        };
        let mut depth = 0;
        let mut i = 0;
        while i < tokens.len() {
            let t = &tokens[i];
            if t.is("{") {
                depth += 1;
            } else if t.is("}") {
                depth -= 1;
            } else if depth == 0 && t.is("typedef") {
                let end = (i..tokens.len())
                    .find(|&j| tokens[j].is(";"))
                    .ok_or("unterminated typedef")?;
                let words: Vec<String> =
                    tokens[i + 1..end].iter().map(|t| t.text.clone()).collect();
                if let Some((name, ty)) = words.split_last() {
                    types.typedefs.insert(name.clone(), ty.to_vec());
                }
                i = end;
            } else if depth == 0 && t.is("struct") && tokens.get(i + 2).is_some_and(|b| b.is("{")) {
                let name = tokens[i + 1].text.clone();
                // The body's declarations at its own level, split at `;`
                // and after a member function's body.
                let mut declarations: Vec<Vec<&Tok>> = vec![Vec::new()];
                let mut inner = 0;
                let mut j = i + 3;
                loop {
                    let t = tokens
                        .get(j)
                        .ok_or_else(|| format!("struct {name} is not closed"))?;
                    j += 1;
                    if t.is("{") {
                        inner += 1;
                    } else if t.is("}") && inner == 0 {
                        break;
                    } else if t.is("}") {
                        inner -= 1;
                        if inner == 0 {
                            declarations.push(Vec::new());
                        }
                    } else if inner == 0 && t.is(";") {
                        declarations.push(Vec::new());
                    } else if inner == 0 {
                        declarations.last_mut().expect("one at least").push(t);
                    }
                }
                let mut fields = Vec::new();
                // Data members only: no functions, no `static`.
                for declaration in declarations
                    .iter()
                    .filter(|d| !d.is_empty() && !d.iter().any(|t| t.is("(") || t.is("static")))
                {
                    let declaration: Vec<Tok> = declaration.iter().map(|t| (*t).clone()).collect();
                    let parts = split_commas(&declaration);
                    // `u32 a, b;`: the first part holds the type, the others a name each.
                    let first = &parts[0];
                    let ty: Vec<String> = first[..first.len() - 1]
                        .iter()
                        .map(|t| t.text.clone())
                        .collect();
                    for part in &parts {
                        let name = part.last().map(|t| t.text.clone()).unwrap_or_default();
                        let mut field = ty.clone();
                        field.push(name);
                        fields.push(field);
                    }
                }
                types.structs.insert(name, fields);
                i = j;
                continue;
            }
            i += 1;
        }
        Ok(types)
    }

    /// The kind of one parameter (type tokens, then its name).
    fn kind(&self, param: &[&Tok]) -> Result<Kind, String> {
        if param.iter().any(|t| t.is("*")) {
            return Ok(Kind::Ptr);
        }
        let words: Vec<String> = param
            .iter()
            .filter(|t| !QUALIFIERS.contains(&t.text.as_str()))
            .map(|t| t.text.clone())
            .collect();
        if words.iter().any(|w| w == "&" || w == "[") {
            return Err(format!(
                "parameter {} is not passed by value",
                words.join(" ")
            ));
        }
        // The last word names the parameter; kernels name them all.
        let ty = &words[..words.len().saturating_sub(1)];
        self.type_kind(ty)
    }

    fn resolve(&self, ty: &[String]) -> Vec<String> {
        match ty {
            [single] => match self.typedefs.get(single) {
                Some(aliased) => self.resolve(aliased),
                None => ty.to_vec(),
            },
            _ => ty.to_vec(),
        }
    }

    fn type_kind(&self, ty: &[String]) -> Result<Kind, String> {
        let ty = self.resolve(ty);
        let words: Vec<&str> = ty.iter().map(String::as_str).collect();
        Ok(match words.as_slice() {
            ["int"] | ["signed", "int"] | ["signed"] => Kind::I32,
            ["unsigned"] | ["unsigned", "int"] => Kind::U32,
            ["unsigned", "long", "long"] | ["unsigned", "long", "long", "int"] => Kind::U64,
            ["float"] => Kind::F32,
            [name] if self.structs.contains_key(*name) => Kind::Struct {
                name: Box::leak(name.to_string().into_boxed_str()),
                bytes: self.struct_layout(name)?.0,
            },
            _ => return Err(format!("no kind for the parameter type `{}`", ty.join(" "))),
        })
    }

    /// Size and alignment of a type as the kernels see it.
    fn layout(&self, ty: &[String]) -> Result<(usize, usize), String> {
        if ty.iter().any(|w| w == "*") {
            return Ok((8, 8));
        }
        let words: Vec<String> = ty
            .iter()
            .filter(|w| !QUALIFIERS.contains(&w.as_str()))
            .cloned()
            .collect();
        let resolved = self.resolve(&words);
        let words: Vec<&str> = resolved.iter().map(String::as_str).collect();
        Ok(match words.as_slice() {
            ["unsigned", "char"] | ["char"] | ["signed", "char"] | ["bool"] => (1, 1),
            ["unsigned", "short"] | ["short"] => (2, 2),
            ["int"] | ["unsigned"] | ["unsigned", "int"] | ["float"] => (4, 4),
            ["unsigned", "long", "long"] | ["long", "long"] | ["double"] => (8, 8),
            [name] if self.structs.contains_key(*name) => self.struct_layout(name)?,
            _ => return Err(format!("no layout for the type `{}`", words.join(" "))),
        })
    }

    fn struct_layout(&self, name: &str) -> Result<(usize, usize), String> {
        let mut size = 0usize;
        let mut align = 1usize;
        for field in &self.structs[name] {
            let (bytes, field_align) = self.layout(&field[..field.len() - 1])?;
            size = size.next_multiple_of(field_align) + bytes;
            align = align.max(field_align);
        }
        Ok((size.next_multiple_of(align), align))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_and_their_parameter_kinds() {
        let source = "typedef unsigned int u32;\n\
             struct S { u32 a, b; float c; __device__ int f() const { return 1; } \
             unsigned long long d; };\n\
             #define ARGS const float* __restrict__ x, u32 n, \\\n int f, S s\n\
             extern \"C\" __global__ void __launch_bounds__(256, 1) k(ARGS) {}\n\
             __global__ void mangled(float x) {}\n\
             extern \"C\" __global__ void two(unsigned long long a, float b) { if (a) {} }\n";
        let unit = kernels(source).unwrap();
        let s = Kind::Struct {
            name: "S",
            bytes: 24,
        };
        assert_eq!(unit.kernels["k"], [Kind::Ptr, Kind::U32, Kind::I32, s]);
        assert_eq!(unit.kernels["two"], [Kind::U64, Kind::F32]);
        assert_eq!(unit.mangled, ["mangled"]);
        assert!(kernels("extern \"C\" __global__ void k(double d) {}")
            .unwrap_err()
            .contains("double"));
    }
}
