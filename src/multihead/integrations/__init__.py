"""Integrations with other libraries (floor 4: they import optional dependencies).

* :mod:`multihead.integrations.hf`: a Hugging Face ``transformers`` attention backend,
  ``multihead.integrations.hf.register()`` then ``attn_implementation="multihead"``
  (``docs/integrations.md``).

Nothing here is imported by ``import multihead``; each module imports its library when it is
itself imported.
"""
