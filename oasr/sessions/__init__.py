"""Sessions: a live stream's whole state as a versioned, checksummed byte string, and back.

| module | what |
|---|---|
| ``format`` | the byte format (header, sections, checksum): encode and read a session |
| ``stream`` | capture a stream's caches into a session and restore them (save/load a stream or a ``StreamContext``) |
| ``decoder_rows`` | the attention decoder's K/V rows as a session section (pages written once, shared on load) |

``docs/sessions.md`` describes the format.
"""
