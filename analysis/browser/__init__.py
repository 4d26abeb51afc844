"""``tensortape serve``: the HTTP server, its JSON API and the page (``static/``).

Private: every module here starts with ``_``."""
