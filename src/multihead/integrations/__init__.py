"""Integrations with other libraries (floor 4: they import optional dependencies).

* :mod:`multihead.integrations.hf`: a Hugging Face ``transformers`` attention backend,
  ``multihead.integrations.hf.register()`` then ``attn_implementation="multihead"``
  (``docs/integrations.md``).
* :mod:`multihead.integrations.export`: ``torch.export`` of a self-attention layer with a dynamic
  sequence length (key padding as a ``lengths`` tensor input), and ONNX through
  ``torch.onnx.export(..., dynamo=True)`` (``pip install "multihead[onnx]"``).

Nothing here is imported by ``import multihead``; each module imports its library when it is
itself imported.
"""
