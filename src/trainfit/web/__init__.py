"""``trainfit serve``: a local page over the library's JSON (see :mod:`trainfit.web.app`).

Importing this package is cheap and needs nothing beyond trainfit; :mod:`trainfit.web.app` needs the ``web``
extra (starlette, uvicorn, plotly): ``pip install 'trainfit[web]'``.
"""
