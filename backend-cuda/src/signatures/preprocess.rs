//! Just enough of the C preprocessor to read the kernels' entry points out
//! of a translation unit (`sources::translation_unit` / `format_unit`):
//! line splicing, comments, `#define` (object- and function-like, `#`,
//! `##`, `__VA_ARGS__`), `#undef`, `#ifdef` / `#ifndef` / `#else` /
//! `#endif`, and macro expansion with hide sets (rescanning, no recursion),
//! as the C standard describes it. Anything else it meets (`#if`,
//! `#include`, ...) is an error naming the directive, not a silent guess.
//!
//! Then [`kernels`] lists every `extern "C" __global__` function of the
//! expanded unit with its parameter kinds (a struct taken by value with its
//! size as the unit lays it out).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::Kind;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokKind {
    Ident,
    Number,
    Literal,
    Punct,
    /// Stands in for an empty macro argument next to `##`.
    Placemarker,
}

#[derive(Clone, Debug)]
struct Tok {
    kind: TokKind,
    text: String,
    /// Macros that must not expand this token again.
    hide: BTreeSet<String>,
}

impl Tok {
    fn is(&self, text: &str) -> bool {
        self.kind != TokKind::Literal && self.text == text
    }
}

const PUNCTS: &[&str] = &[
    "...", "<<=", ">>=", "->", "++", "--", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||", "+=",
    "-=", "*=", "/=", "%=", "&=", "|=", "^=", "##", "::",
];

fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let tok = |kind, text: String| Tok {
        kind,
        text,
        hide: BTreeSet::new(),
    };
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(tok(TokKind::Ident, chars[start..i].iter().collect()));
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
        {
            let start = i;
            i += 1;
            while i < chars.len() {
                let d = chars[i];
                let exponent_sign =
                    (d == '+' || d == '-') && matches!(chars[i - 1], 'e' | 'E' | 'p' | 'P');
                if !(d.is_ascii_alphanumeric() || d == '_' || d == '.' || exponent_sign) {
                    break;
                }
                i += 1;
            }
            out.push(tok(TokKind::Number, chars[start..i].iter().collect()));
        } else if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            if i >= chars.len() {
                return Err(format!(
                    "unterminated literal {}",
                    chars[start..].iter().take(40).collect::<String>()
                ));
            }
            i += 1;
            out.push(tok(TokKind::Literal, chars[start..i].iter().collect()));
        } else {
            let rest: String = chars[i..chars.len().min(i + 3)].iter().collect();
            let punct = PUNCTS
                .iter()
                .find(|p| rest.starts_with(**p))
                .map_or_else(|| c.to_string(), |p| p.to_string());
            i += punct.chars().count();
            out.push(tok(TokKind::Punct, punct));
        }
    }
    Ok(out)
}

/// Phases 2 and 3: backslash-newlines spliced, each comment a space.
fn splice_and_strip_comments(source: &str) -> String {
    let spliced = source.replace("\\\r\n", "").replace("\\\n", "");
    let chars: Vec<char> = spliced.chars().collect();
    let mut out = String::with_capacity(spliced.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != c && chars[i] != '\n' {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i = (i + 1).min(chars.len());
            out.extend(&chars[start..i]);
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            out.push(' ');
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

#[derive(Clone, Debug)]
enum Macro {
    Object(Vec<Tok>),
    Function {
        params: Vec<String>,
        variadic: bool,
        body: Vec<Tok>,
    },
}

#[derive(Default)]
struct Preprocessor {
    macros: HashMap<String, Macro>,
}

impl Preprocessor {
    fn define(&mut self, rest: &str) -> Result<(), String> {
        let rest = rest.trim_start();
        let name_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = &rest[..name_len];
        if name.is_empty() {
            return Err(format!("#define without a name: {rest}"));
        }
        let after = &rest[name_len..];
        let definition = if let Some(params) = after.strip_prefix('(') {
            let close = params
                .find(')')
                .ok_or_else(|| format!("#define {name}: unterminated parameter list"))?;
            let mut names: Vec<String> = params[..close]
                .split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect();
            let variadic = names.last().is_some_and(|p| p == "...");
            if variadic {
                names.pop();
                names.push("__VA_ARGS__".to_string());
            }
            Macro::Function {
                params: names,
                variadic,
                body: lex(&params[close + 1..])?,
            }
        } else {
            Macro::Object(lex(after)?)
        };
        self.macros.insert(name.to_string(), definition);
        Ok(())
    }

    /// Macro expansion of `input` to the end (Prosser's algorithm).
    fn expand(&self, input: Vec<Tok>) -> Result<Vec<Tok>, String> {
        let mut input: VecDeque<Tok> = input.into();
        let mut out = Vec::new();
        while let Some(tok) = input.pop_front() {
            let definition = match self.macros.get(&tok.text) {
                Some(d) if tok.kind == TokKind::Ident && !tok.hide.contains(&tok.text) => d,
                _ => {
                    out.push(tok);
                    continue;
                }
            };
            let replacement = match definition {
                Macro::Object(body) => {
                    let mut hide = tok.hide.clone();
                    hide.insert(tok.text.clone());
                    self.substitute(body, &[], &[], &hide)?
                }
                Macro::Function {
                    params,
                    variadic,
                    body,
                } => {
                    if !input.front().is_some_and(|t| t.is("(")) {
                        out.push(tok);
                        continue;
                    }
                    input.pop_front();
                    let (mut args, close) = collect_args(&mut input, &tok.text)?;
                    if params.is_empty() && args.len() == 1 && args[0].is_empty() {
                        args.clear();
                    }
                    if *variadic && args.len() > params.len() {
                        let rest = args.split_off(params.len() - 1);
                        let mut joined = Vec::new();
                        for (i, arg) in rest.into_iter().enumerate() {
                            if i > 0 {
                                joined.push(punct(","));
                            }
                            joined.extend(arg);
                        }
                        args.push(joined);
                    }
                    if *variadic && args.len() + 1 == params.len() {
                        args.push(Vec::new());
                    }
                    if args.len() != params.len() {
                        return Err(format!(
                            "macro {} takes {} arguments, given {}",
                            tok.text,
                            params.len(),
                            args.len()
                        ));
                    }
                    let mut hide: BTreeSet<String> =
                        tok.hide.intersection(&close.hide).cloned().collect();
                    hide.insert(tok.text.clone());
                    self.substitute(body, params, &args, &hide)?
                }
            };
            for t in replacement.into_iter().rev() {
                input.push_front(t);
            }
        }
        Ok(out)
    }

    /// A macro body with its parameters replaced (`#` stringizes, `##`
    /// pastes, other uses take the fully expanded argument), every token
    /// then hidden from the macros in `hide`.
    fn substitute(
        &self,
        body: &[Tok],
        params: &[String],
        args: &[Vec<Tok>],
        hide: &BTreeSet<String>,
    ) -> Result<Vec<Tok>, String> {
        let param = |t: &Tok| {
            (t.kind == TokKind::Ident)
                .then(|| params.iter().position(|p| *p == t.text))
                .flatten()
        };
        let raw = |index: usize| {
            if args[index].is_empty() {
                vec![Tok {
                    kind: TokKind::Placemarker,
                    text: String::new(),
                    hide: BTreeSet::new(),
                }]
            } else {
                args[index].clone()
            }
        };
        let mut out: Vec<Tok> = Vec::new();
        let mut i = 0;
        while i < body.len() {
            let t = &body[i];
            let next = body.get(i + 1);
            if t.is("#") && !params.is_empty() {
                let index = next
                    .and_then(param)
                    .ok_or_else(|| "# not followed by a macro parameter".to_string())?;
                let text: Vec<&str> = args[index].iter().map(|a| a.text.as_str()).collect();
                out.push(Tok {
                    kind: TokKind::Literal,
                    text: format!("{:?}", text.join(" ")),
                    hide: BTreeSet::new(),
                });
                i += 2;
            } else if t.is("##") {
                let rhs_tok = next.ok_or_else(|| "## at the end of a macro".to_string())?;
                let rhs = match param(rhs_tok) {
                    Some(index) => raw(index),
                    None => vec![rhs_tok.clone()],
                };
                let lhs = out
                    .pop()
                    .ok_or_else(|| "## at the start of a macro".to_string())?;
                let mut rhs = rhs.into_iter();
                let first = rhs.next().expect("raw() is never empty");
                out.push(paste(lhs, first)?);
                out.extend(rhs);
                i += 2;
            } else if let Some(index) = param(t) {
                if next.is_some_and(|n| n.is("##")) {
                    out.extend(raw(index));
                } else {
                    out.extend(self.expand(args[index].clone())?);
                }
                i += 1;
            } else {
                out.push(t.clone());
                i += 1;
            }
        }
        Ok(out
            .into_iter()
            .filter(|t| t.kind != TokKind::Placemarker)
            .map(|mut t| {
                t.hide.extend(hide.iter().cloned());
                t
            })
            .collect())
    }
}

fn punct(text: &str) -> Tok {
    Tok {
        kind: TokKind::Punct,
        text: text.to_string(),
        hide: BTreeSet::new(),
    }
}

fn paste(lhs: Tok, rhs: Tok) -> Result<Tok, String> {
    if lhs.kind == TokKind::Placemarker {
        return Ok(rhs);
    }
    if rhs.kind == TokKind::Placemarker {
        return Ok(lhs);
    }
    let text = format!("{}{}", lhs.text, rhs.text);
    let mut tokens = lex(&text)?;
    if tokens.len() != 1 {
        return Err(format!(
            "pasting {} and {} gives no single token",
            lhs.text, rhs.text
        ));
    }
    Ok(tokens.remove(0))
}

/// A function-like macro's arguments, after its `(`, and the closing `)`.
fn collect_args(input: &mut VecDeque<Tok>, name: &str) -> Result<(Vec<Vec<Tok>>, Tok), String> {
    let mut args = vec![Vec::new()];
    let mut depth = 0;
    while let Some(t) = input.pop_front() {
        if t.is(")") && depth == 0 {
            return Ok((args, t));
        }
        if t.is("(") {
            depth += 1;
        } else if t.is(")") {
            depth -= 1;
        }
        if t.is(",") && depth == 0 {
            args.push(Vec::new());
        } else {
            args.last_mut().expect("one argument at least").push(t);
        }
    }
    Err(format!("unterminated call of macro {name}"))
}

/// The tokens of a translation unit after preprocessing.
fn preprocess(source: &str) -> Result<Vec<Tok>, String> {
    let text = splice_and_strip_comments(source);
    let mut pp = Preprocessor::default();
    let mut out = Vec::new();
    // Per open conditional: whether its current branch is live, and whether
    // the conditional was live where it opened.
    let mut conditions: Vec<(bool, bool)> = Vec::new();
    let live = |conditions: &[(bool, bool)]| conditions.iter().all(|c| c.0);
    let mut pending = String::new();
    for (number, line) in text.lines().enumerate() {
        let Some(directive) = line.trim_start().strip_prefix('#') else {
            if live(&conditions) {
                pending.push_str(line);
                pending.push('\n');
            }
            continue;
        };
        let directive = directive.trim_start();
        let word_len = directive
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(directive.len());
        let (word, rest) = directive.split_at(word_len);
        let at = |message: String| format!("line {} (`{}`): {message}", number + 1, line.trim());
        if live(&conditions) && !pending.is_empty() {
            out.extend(
                pp.expand(lex(&std::mem::take(&mut pending)).map_err(at)?)
                    .map_err(at)?,
            );
        }
        let outer_live = live(&conditions);
        match word {
            "ifdef" | "ifndef" => {
                let defined = pp.macros.contains_key(rest.trim());
                conditions.push((defined == (word == "ifdef"), outer_live));
            }
            "else" => {
                let c = conditions
                    .last_mut()
                    .ok_or_else(|| at("#else without #if".into()))?;
                c.0 = !c.0;
            }
            "endif" => {
                conditions
                    .pop()
                    .ok_or_else(|| at("#endif without #if".into()))?;
            }
            _ if !outer_live => {}
            "define" => pp.define(rest).map_err(at)?,
            "undef" => {
                pp.macros.remove(rest.trim());
            }
            "pragma" | "line" | "" => {}
            other => return Err(at(format!("the preprocessor here does not do #{other}"))),
        }
    }
    if !conditions.is_empty() {
        return Err("unterminated #ifdef/#ifndef".into());
    }
    out.extend(pp.expand(lex(&pending)?)?);
    Ok(out)
}

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

    fn texts(source: &str) -> String {
        preprocess(source)
            .unwrap()
            .iter()
            .map(|t| t.text.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn macros_expand_paste_and_rescan_as_c_does() {
        let source = "#define A(x) x##_t1 x ## 2\n#define EACH(M) M(f32, 1) M(q4_k, 2)\n\
             #define ENTRY(S, F) k_##S##_v(F)\nEACH(ENTRY) A(f)\n\
             #define R R + 1\nR // not recursive\n#define E(x, y) [x##y]\nE(, b) E(a, )\n";
        assert_eq!(
            texts(source),
            "k_f32_v ( 1 ) k_q4_k_v ( 2 ) f_t1 f2 R + 1 [ b ] [ a ]"
        );
    }

    #[test]
    fn directives_define_undefine_and_choose() {
        let source = "#define KV float\nKV\n#undef KV\n#define KV u16\nKV\n\
             #ifndef KV\nno\n#else\nyes\n#endif\n\
             #ifdef NOPE\n#define X 1\n#endif\nX /* a\n comment */ \"// kept\"\n";
        assert_eq!(texts(source), "float u16 yes X \"// kept\"");
        assert!(preprocess("#if 1\n#endif\n").unwrap_err().contains("#if"));
        assert!(preprocess("#include <x.h>\n")
            .unwrap_err()
            .contains("#include"));
    }

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
