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

use std::collections::{BTreeSet, HashMap, VecDeque};

mod declarations;

pub(crate) use declarations::{kernels, Unit};

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
}
