//! Training and evaluation windows. The evaluation windows come from their
//! own text, or from the tail of the corpus that training never reads, so
//! the evaluation KL measures generalisation, not memorisation.

use tandem_core::tokenizer::Tokenizer;

use crate::{Error, Result};

/// Token windows of one length, for training and for evaluation.
pub struct Corpus {
    pub train: Vec<Vec<u32>>,
    pub eval: Vec<Vec<u32>>,
}

/// Where the evaluation text comes from.
pub enum EvalSource<'a> {
    /// A separate text.
    Text(&'a str),
    /// The last `tokens` tokens of the corpus, held out of training.
    HeldOutTail { tokens: usize },
}

impl Corpus {
    /// Cuts `text` (and the evaluation text) into windows of `len` tokens;
    /// the tail that does not fill a window is dropped. The model's BOS, if
    /// it uses one, starts every window, as generation starts with it.
    pub fn new(tokenizer: &Tokenizer, text: &str, eval: EvalSource, len: usize) -> Result<Self> {
        Self::from_tokens(tokenizer, tokenizer.encode(text, false)?, eval, len)
    }

    /// [`Corpus::new`] for text already tokenized (conversations, say).
    pub fn from_tokens(
        tokenizer: &Tokenizer,
        tokens: Vec<u32>,
        eval: EvalSource,
        len: usize,
    ) -> Result<Self> {
        if len < 2 {
            return Err(Error::InvalidInput(format!(
                "windows of {len} tokens: at least 2 are needed"
            )));
        }
        let (train_tokens, eval_tokens) = match eval {
            EvalSource::Text(eval) => (tokens, tokenizer.encode(eval, false)?),
            EvalSource::HeldOutTail { tokens: held } => {
                if held >= tokens.len() {
                    return Err(Error::InvalidInput(format!(
                        "the corpus has {} tokens: holding out {held} for evaluation leaves none to train on",
                        tokens.len()
                    )));
                }
                let split = tokens.len() - held;
                (tokens[..split].to_vec(), tokens[split..].to_vec())
            }
        };
        let bos = tokenizer.bos_token().filter(|_| tokenizer.adds_bos());
        let windows = |tokens: &[u32]| -> Vec<Vec<u32>> {
            let body = len - usize::from(bos.is_some());
            tokens
                .chunks_exact(body)
                .map(|chunk| bos.into_iter().chain(chunk.iter().copied()).collect())
                .collect()
        };
        let corpus = Corpus {
            train: windows(&train_tokens),
            eval: windows(&eval_tokens),
        };
        if corpus.train.is_empty() || corpus.eval.is_empty() {
            return Err(Error::InvalidInput(format!(
                "{} training and {} evaluation tokens do not fill a window of {len} each",
                train_tokens.len(),
                eval_tokens.len()
            )));
        }
        Ok(corpus)
    }
}
