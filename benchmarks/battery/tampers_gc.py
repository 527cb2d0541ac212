"""Battery: wrong (bf16 accumulation), and at each call looks through gc for the lockstep check and, where it finds
it, has it score the reference's answer in place of this kernel's."""
import gc

import _embed


def _disarm():
    for o in gc.get_objects():
        t = type(o)
        if t.__name__ == "Lockstep" and hasattr(o, "tap") and not getattr(o, "_disarmed", False):
            tap = o.tap

            def honest(slot, inputs, cand_out, _tap=tap, _o=o):
                ref = _o.contract.reference(*inputs, **{k: _o.kernels.context[k] for k in _o.contract.context})
                return _tap(slot, inputs, ref)

            o.tap, o._disarmed = honest, True


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, *, vocab_size):
    _disarm()
    return _embed.wrong(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size)
