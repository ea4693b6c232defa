package egress

import (
	"fmt"
	"net"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
)

// httpStatus is the HTTP status a CONNECT gets for a dial that failed with
// code: kube-apiserver shows the status line and the body in its error for
// the webhook or APIService call.
func httpStatus(code codes.Code) int {
	switch code {
	case codes.InvalidArgument:
		return http.StatusBadRequest
	case codes.PermissionDenied, codes.Unauthenticated:
		return http.StatusForbidden
	case codes.NotFound:
		return http.StatusNotFound
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	}
	return http.StatusBadGateway
}

// maxReason bounds the reason in an answer's body.
const maxReason = 512

// reply writes an answer without a tunnel: its status, a short reason, and
// the end of the connection.
func reply(conn net.Conn, code int, reason string, header ...string) error {
	if len(reason) > maxReason {
		reason = reason[:maxReason] + "..."
	}
	reason = strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, reason) + "\n"
	head := fmt.Sprintf("HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n",
		code, http.StatusText(code), len(reason))
	for _, h := range header {
		head += h + "\r\n"
	}
	_, err := conn.Write([]byte(head + "\r\n" + reason))
	return err
}

// established is the answer to a CONNECT whose tunnel is up.
const established = "HTTP/1.1 200 Connection established\r\n\r\n"
