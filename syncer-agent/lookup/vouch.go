package lookup

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"
)

// Anyone who may write EndpointSlices can write any address into one, and
// any label or owner reference onto it. So, unless the operator trusts a
// namespace's slices as written (KubeOptions.TrustEndpointSlicesIn), the
// agent dials only what the control plane itself vouches for: an address
// of a Pod that the Service selects, as the Pod's own status gives it.
// The slice's provenance is checked first, for clear messages about the
// common mistakes; the Pod is what makes forging one pointless.

// unvouchedSlice says why slice is not one that Kubernetes' EndpointSlice
// controller wrote for svc, or "" if it looks like one: managed by the
// controller and controlled by svc itself (by name and UID, so not by an
// earlier Service of the same name).
func unvouchedSlice(slice *discoveryv1.EndpointSlice, svc *corev1.Service) string {
	if slice.Labels[discoveryv1.LabelManagedBy] != EndpointSliceController {
		return fmt.Sprintf("EndpointSlice %s is not managed by %s", slice.Name, EndpointSliceController)
	}
	owner := metav1.GetControllerOfNoCopy(slice)
	if owner == nil || owner.APIVersion != "v1" || owner.Kind != "Service" || owner.Name != svc.Name || owner.UID != svc.UID {
		return fmt.Sprintf("EndpointSlice %s is not owned by the Service (it has no controller owner reference to Service %s with UID %s)",
			slice.Name, svc.Name, svc.UID)
	}
	return ""
}

// podOf returns the Pod that an endpoint's targetRef names, if it is one
// the Service selects and whose address may be dialed; otherwise why not.
// The caller still checks that each address of the endpoint is the Pod's.
func podOf(pods cache.Indexer, ref *corev1.ObjectReference, svc *corev1.Service, selector labels.Selector) (*cachedPod, string) {
	if ref == nil || ref.Kind != "Pod" || ref.Name == "" {
		return nil, "names no Pod"
	}
	if ref.Namespace != svc.Namespace {
		return nil, fmt.Sprintf("names Pod %s/%s, not one of the Service's namespace", ref.Namespace, ref.Name)
	}
	obj, exists, err := pods.GetByKey(svc.Namespace + "/" + ref.Name)
	pod, slimmed := obj.(*cachedPod) // always, by the informer's transform
	if err != nil || !exists || !slimmed {
		return nil, fmt.Sprintf("names Pod %s, which does not exist", ref.Name)
	}
	switch {
	case !selector.Matches(labels.Set(pod.Labels)):
		return nil, fmt.Sprintf("names Pod %s, which the Service does not select", pod.Name)
	case pod.hostNetwork:
		return nil, fmt.Sprintf("names Pod %s, which uses its node's network (hostNetwork): its address is the node's", pod.Name)
	case pod.ended:
		return nil, fmt.Sprintf("names Pod %s, which has ended", pod.Name)
	case pod.DeletionTimestamp != nil:
		return nil, fmt.Sprintf("names Pod %s, which is being deleted", pod.Name)
	}
	return pod, ""
}
