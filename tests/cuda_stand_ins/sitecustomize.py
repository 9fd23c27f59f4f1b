"""CUDA's rules and failures, stood in for on a CPU in every process of a test run (the learner,
actors, env clients): tests put this directory first on PYTHONPATH and name what to emulate.

TBH_EMULATE_CUDNN_RNN=1: nn.LSTM refuses a non-contiguous hidden state, as cuDNN does
("rnn: hx is not contiguous"); torch's CPU kernel accepts one.
"""

import os

if os.environ.get("TBH_EMULATE_CUDNN_RNN") == "1":
    from torch import nn

    _forward = nn.LSTM.forward

    def _forward_as_cudnn(self, input, hx=None):
        if hx is not None and not all(h.is_contiguous() for h in hx):
            raise RuntimeError("rnn: hx is not contiguous")  # cuDNN's words
        return _forward(self, input, hx)

    nn.LSTM.forward = _forward_as_cudnn
