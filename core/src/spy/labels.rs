//! An iseq's labels as Ruby prints them where they are not read as they are: 3.4's
//! rescue, ensure and eval clauses labelled as their code, and 4.1's base label, which no
//! field keeps any more.
use super::leaves::Attempt;
use super::walker::Walker;
use crate::memory::{word, word32, Memory};
use crate::objects::read_string;
use std::sync::Arc;

impl<M: Memory> Walker<'_, M> {
    /// The label Ruby 3.4 gives the iseq whose body is `b`: for rescue, ensure and eval code,
    /// the label of the nearest ancestor of another kind (`calculate_iseq_label`); `label`,
    /// its own, for any other iseq.
    pub(super) fn clause_label(
        &self,
        b: &[u8],
        label: String,
    ) -> std::result::Result<String, Attempt> {
        let l = self.target.layout;
        let mem = &self.target.mem;
        let mut label = label;
        let mut body = b.to_vec();
        for _ in 0..64 {
            let kind = word32(&body, l.body_type);
            if ![l.iseq_type_rescue, l.iseq_type_ensure, l.iseq_type_eval].contains(&kind) {
                break;
            }
            let parent = word(&body, l.body_parent_iseq);
            if parent == 0 {
                break;
            }
            let parent_body =
                self.target
                    .read_word(parent, l.iseq_body, "reading a parent iseq")?;
            body = mem
                .read_vec(parent_body, l.body_read_size)
                .map_err(self.target.moved("reading a parent iseq"))?;
            label = read_string(mem, l, word(&body, l.body_location_label))
                .map_err(|e| self.target.object_moved("reading an iseq label", e))?;
        }
        Ok(label)
    }

    /// The base label of the iseq whose body is `b` (at `body`; its local iseq's body at
    /// `local_body`), `label` its own: `location.base_label` where the Ruby has it; else
    /// (4.1.0) derived from the local iseq's label as iseq.c's `rb_iseq_base_label` does, a
    /// block's method name, and an iseq's own label for the rest.
    pub(super) fn base_label(
        &self,
        b: &[u8],
        body: u64,
        local_body: Option<u64>,
        label: &Arc<str>,
    ) -> std::result::Result<Arc<str>, Attempt> {
        let l = self.target.layout;
        let text = |v: u64| {
            read_string(&self.target.mem, l, v)
                .map(Arc::from)
                .map_err(|e| self.target.object_moved("reading an iseq label", e))
        };
        match (l.body_location_base_label, local_body) {
            (Some(at), _) => text(word(b, at)),
            (None, Some(local_body)) if local_body != body => text(self.target.read_word(
                local_body,
                l.body_location_label,
                "reading a local iseq's label",
            )?),
            (None, _) => Ok(label.clone()),
        }
    }
}
