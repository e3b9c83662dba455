"""A real TLS server in front of a plain one, for the object-storage tests
(Garage's S3 API has no TLS): accepts TLS on 127.0.0.1 with a certificate
and key, and pumps each connection's plaintext both ways to a TCP target.

    python3 tls_proxy.py CERT KEY TARGET_PORT

prints the port it listens on, then serves until killed. One thread per
connection, each pumping both directions with select(), so one TLS socket
is never read and written from two threads at once. A client that refuses
the certificate ends its connection during the handshake: nothing is sent
to the target.
"""

import select
import socket
import ssl
import sys
import threading

CHUNK = 1 << 18


def serve(context: ssl.SSLContext, conn: socket.socket, target_port: int) -> None:
    try:
        tls = context.wrap_socket(conn, server_side=True)
    except (ssl.SSLError, OSError):
        conn.close()
        return
    try:
        upstream = socket.create_connection(("127.0.0.1", target_port))
    except OSError:
        tls.close()
        return
    peer = {tls: upstream, upstream: tls}
    try:
        while True:
            # Bytes already decrypted into the TLS object are no longer
            # on the socket: select() would not see them.
            ready = [tls] if tls.pending() else select.select([tls, upstream], [], [])[0]
            for sock in ready:
                data = sock.recv(CHUNK)
                if not data:
                    return
                peer[sock].sendall(data)
    except (ssl.SSLError, OSError):
        pass
    finally:
        upstream.close()
        tls.close()


def main() -> None:
    cert, key, target_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(context, conn, target_port), daemon=True).start()


if __name__ == "__main__":
    main()
