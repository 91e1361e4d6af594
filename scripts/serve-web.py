#!/usr/bin/env python3
"""The demo site on a local port, cross-origin isolated.

    scripts/serve-web.py SITE_DIR [PORT]

Python's static server, plus the two headers that make the page
cross-origin isolated (`crossOriginIsolated`), which SharedArrayBuffer, and
so the threaded wasm build of the CPU backend, needs:
`Cross-Origin-Opener-Policy: same-origin` and
`Cross-Origin-Embedder-Policy: require-corp`. Everything is served from
this origin, so nothing else needs CORS or CORP headers. Without them the
page still works, on one CPU thread, and says so.
"""
import functools
import http.server
import sys


class IsolatedHandler(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()


def main():
    if not 2 <= len(sys.argv) <= 3:
        sys.exit("usage: scripts/serve-web.py SITE_DIR [PORT]")
    site = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) == 3 else 8000
    # .wasm must go out as application/wasm for streaming compilation.
    IsolatedHandler.extensions_map[".wasm"] = "application/wasm"
    handler = functools.partial(IsolatedHandler, directory=site)
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        print(f"Tandem chat on http://127.0.0.1:{port}/ (cross-origin isolated)", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
